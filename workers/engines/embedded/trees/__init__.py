"""The draft tree of the embedded engine: its shape (tree.py), its attention over the KV cache
(attention.py), sampling and acceptance along it (sampling.py), and one tree step (step.py)."""
