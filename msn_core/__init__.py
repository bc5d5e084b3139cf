"""Torch-free ground floor shared by ``training``, ``msn_serve`` and ``visualizer`` (numpy + stdlib only).

What both sides of the torch boundary must agree on lives here once:

* :mod:`msn_core.bundle`: the ``msn.json`` schema, its format version, reader/validator and writer, and the
  ONNX graph's input contract;
* :mod:`msn_core.preprocessing`: what the bundle's preprocessing means (geometry, normalisation, the Pillow
  pipeline the service runs; training's batched torch version takes its geometry from here);
* :mod:`msn_core.inference`: running an exported graph on ONNX Runtime or OpenVINO, with one set of settings for
  serving, evaluation and the export's measurements;
* :mod:`msn_core.masks`: mask specifications -> kept-patch indices, with the one seeded RNG definition;
* :mod:`msn_core.features`: the names of the frozen features;
* :mod:`msn_core.lowshot`: the MSN low-shot classifier (row centring + L2, cyanure fit, one default lambda);
* :mod:`msn_core.durable`: atomic, fsync'd file writes, durable removal, quarantine and the data directory's lock;
* :mod:`msn_core.hardware`: what the CPU can do.

This package imports none of the three packages above, and never torch (a test enforces both). ``import msn_core``
needs numpy and the standard library only: cyanure, onnxruntime, openvino and Pillow are imported inside the
functions that use them (a test enforces that too).
"""
