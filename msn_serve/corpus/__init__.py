"""Offline bulk embedding (``msn-embed``): a listed corpus through the serving engine into resumable shards, and
on request a Parquet file and an index ``msn-serve`` loads. No torch: it runs on a ``.[serve]`` install."""
