"""How fast and how sturdy ``msn-serve`` is: ONNX Runtime and int8, HTTP load, FAISS, hostile and long-running
clients, and the ViT-S/16 runtimes."""
