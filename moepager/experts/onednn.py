"""oneDNN's prepacked bf16 matrix-vector kernel on the CPU: a weight laid out once, at load, in the blocked format
oneDNN's bf16 kernels read (AVX512-BF16 dot products where the CPU has them), so no call converts or reorders it.
The dense projections (accel/packed.py) and the opt-in `packed` expert kernel (experts/executor.py) use it; the
measurements that decide where are in accel/packed.py and `python benchmarks/gemv.py`.
"""

from __future__ import annotations

import torch


def packing_available() -> bool:
    """Whether this torch build has oneDNN and its prepacked linear ops (CPU builds of torch 2.x do)."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight") and hasattr(
        ops, "_linear_pointwise")


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] in oneDNN's layout for one-token calls (an opaque oneDNN tensor, a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for W prepacked by `prepack` (any leading dimensions of x)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
