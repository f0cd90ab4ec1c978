"""CPU accelerations applied to a built model: moepager's own CPU kernels (fused MoE layers, a GEMV; cpu_kernels.py),
TorchInductor-compiled decode steps, oneDNN-prepacked and int8 dense projections."""
