"""Checkpoint formats: safetensors and GGUF reading and writing, expert readers, quantized checkpoints, the
O_DIRECT reader, make-model's synthesis, and building a model from a checkpoint."""
