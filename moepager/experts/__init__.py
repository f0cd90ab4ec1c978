"""Expert weights and their computation: flat packing (weights.py), quantized formats (quant.py), the executor seam
and its kernels (executor.py), sorting a layer's tokens by expert (sorting.py), hybrid and split execution, and the
workers' protocol (remote.py). Reading experts from checkpoints is checkpoints/'s."""
