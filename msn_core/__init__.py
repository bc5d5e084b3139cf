"""Torch-free ground floor shared by ``training``, ``msn_serve`` and ``visualizer`` (numpy + stdlib only).

What both sides of the torch boundary must agree on lives here once:

* :mod:`msn_core.bundle`: the ``msn.json`` schema, its format version, reader/validator and writer, and the
  ONNX graph's input contract;
* :mod:`msn_core.masks`: mask specifications -> kept-patch indices, with the one seeded RNG definition;
* :mod:`msn_core.lowshot`: the MSN low-shot classifier (row centring + L2, cyanure fit, one default lambda);
* :mod:`msn_core.durable`: atomic, fsync'd file writes.

This package imports none of the three packages above, and never torch (a test enforces both).
"""
