"""Checkpoint formats: safetensors and GGUF reading and writing, expert readers, the O_DIRECT reader, quantized and
split checkpoints. Below the model code: an architecture's config parsing and tensor names come from its spec
(models/specs.py, a leaf); building a model from a checkpoint is loading/build.py's."""
