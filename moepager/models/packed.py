"""Dense bf16 projections with oneDNN-prepacked weights on the CPU: the same matrix, laid out once at load in the
blocked format oneDNN's bf16 kernels read (AVX512-BF16 dot products where the CPU has them), so no call
converts or reorders a weight. Lossless in the sense of a kernel choice: the products are the same, their
fp32 accumulation order may differ from torch's own GEMV (a result can differ in its last bf16 bit), and every
placement of the experts (resident, paged, prefetched) runs the same kernel.

Measured on this project's CPU (bf16, one token, native GEMV against prepacked oneDNN, us; ad-hoc probe, 1 / 2
threads): 8192x256 376 / 173 and 199 / 78; 5120x2048 1,476 / 740 and 771 / 442; 2048x4096 1,131 / 611;
qwen3-30b-a3b's LM head 151936x2048 74,179 / 47,319 and 38,116 / 25,344 (1.5-2.3x); 16 and 64 tokens gain
1.05-1.3x. Below ~1M elements the fixed cost of a oneDNN call (~17 us) loses (32x256: 3.4 against 17.7 us), so
smaller matrices keep their weights; fp32 does not gain (0.8-1.2x) and keeps them too.
"""

from __future__ import annotations

import torch
from torch import nn

from moepager.models.dense_quant import replace_dense

PACK_MIN_ELEMENTS = 1 << 20
"""Matrices with at least this many elements are prepacked (see the module note)."""


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


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's prepacked layout (a plain attribute: it is an opaque oneDNN tensor,
    neither saved nor moved; the module is made after loading, on the CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = prepack(weight)
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def _packed_if_large(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear | None:
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.numel() < PACK_MIN_ELEMENTS:
        return None
    return PackedLinear(weight, bias)


def pack_dense(model: nn.Module) -> int:
    """Prepack the model's large bf16 dense projections in place (models/dense_quant.py's `replace_dense` picks
    them: attention, dense and shared-expert MLPs, the LM head); returns how many were packed."""
    if not packing_available():
        return 0
    before = sum(isinstance(m, PackedLinear) for m in model.modules())
    replace_dense(model, _packed_if_large)
    return sum(isinstance(m, PackedLinear) for m in model.modules()) - before
