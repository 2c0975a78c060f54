"""Generation from a trained state: the whole model on the mesh (inference.py) and
KV-cache sampling (sample.py)."""
