"""HTTP worker processes around one engine process (``msn-serve --http-workers N|auto``).

One Python process cannot feed a fast engine: its event loop, HTTP parsing, multipart, validation and the glue
around Pillow share one interpreter's lock, about 600 single-image requests a second whatever the cores. Here a
request for an embedding route (``POST /embed``, ``POST /v1/embeddings``, OIP ``POST /v2/models/{m}/infer``) runs in
three stages, as infinity names its pre/core/post:

1. **preparation**, in an HTTP process (:mod:`~msn_serve.workers.prepare`): auth and limits, the body, the mask,
   decoding, the crop and normalisation (the single process's own routes and preparation path,
   :mod:`msn_serve.http.embedder`), each image left as float32 in a slot of the process's ring in shared memory
   (:mod:`~msn_serve.workers.ring`); a small descriptor names the slots (:mod:`~msn_serve.workers.wire`);
2. **the engine**, in the engine process (:mod:`~msn_serve.workers.desk`): the model's batcher packs the images into
   a batch and runs it; the embeddings go back over the link;
3. **the response**, in the HTTP process again, as the single process writes it.

Everything with state stays in the engine process (models and engines, batchers, the index writer and the data
directory's lock, classifiers, snapshots, admin), which also serves every other route through the single-process app
(:mod:`~msn_serve.workers.proxy`), accepts the connections and hands them to the HTTP processes, and restarts one
that dies (:mod:`~msn_serve.workers.supervisor`). ``--http-workers 0`` (the default) is the single process.
"""
