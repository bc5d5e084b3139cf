"""HTTP worker processes around one engine process (``msn-serve --http-workers N|auto``).

One Python process cannot feed a fast engine: its event loop, HTTP parsing, multipart, validation and the glue
around Pillow share one interpreter's lock, about 600 single-image requests a second whatever the cores. Here a
request for ``POST /embed`` runs in three stages, as infinity names its pre/core/post:

1. **preparation**, in an HTTP process (:mod:`~msn_serve.workers.prepare`): auth and limits, the body, the mask,
   decoding and the crop, left as uint8 in a slot of the process's ring in shared memory
   (:mod:`~msn_serve.workers.ring`); a small descriptor names the slots (:mod:`~msn_serve.workers.wire`);
2. **the engine**, in the engine process (:mod:`~msn_serve.workers.desk`): the model's batcher normalises the crops
   while it packs a batch and runs it; the embeddings go back over the link;
3. **the response**, in the HTTP process again: JSON or raw float32, as the single process writes it.

Everything with state stays in the engine process (models and engines, batchers, the index writer and the data
directory's lock, classifiers, snapshots, admin), which also serves every other route through the single-process app
(:mod:`~msn_serve.workers.proxy`), accepts the connections and hands them to the HTTP processes, and restarts one
that dies (:mod:`~msn_serve.workers.supervisor`). ``--http-workers 0`` (the default) is the single process.
"""
