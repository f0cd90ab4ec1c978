"""Model code: one file per architecture, shared blocks in layers.py, checkpoint reading in loader.py."""
