"""Dense bf16 projections with oneDNN-prepacked weights on the CPU: the same matrix, laid out once at load in the
blocked format oneDNN's bf16 kernels read (AVX512-BF16 dot products where the CPU has them), so no call
converts or reorders a weight. Lossless in the sense of a kernel choice: the products are the same, their
fp32 accumulation order may differ from torch's own GEMV (a result can differ in its last bf16 bit), and every
placement of the experts (resident, paged, prefetched) runs the same kernel.

Measured by `python -m benchmarks run gemv` (native GEMV against prepacked oneDNN). Below ~1M elements the fixed
cost of a oneDNN call loses, so smaller matrices keep their weights; fp32 does not gain and keeps them too. The gain
depends on the machine (a host whose torch GEMV reads faster than oneDNN's prepacked kernel loses by it);
`--no-packed-dense` turns it off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moepager.accel import cpu_kernels
from moepager.accel.dense_quant import replace_dense, replace_head
from moepager.experts.onednn import packed_linear, packing_available, prepack
from moepager.models.graph_exit import LeavesGraph, opaque_linear
from moepager.models.layers import CausalLM

PACK_MIN_ELEMENTS = 1 << 20
"""Matrices with at least this many elements are prepacked (see the module note)."""


class PackedLinear(LeavesGraph):
    """y = x W^T + b with W held in oneDNN's prepacked layout (a plain attribute: it is an opaque oneDNN tensor,
    neither saved nor moved; the module is made after loading, on the CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = prepack(weight)
        self.register_buffer("bias", None if bias is None else bias.detach())

    def host_linear(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`LeavesGraph.forward` with `host_linear` written out: the head of every decode step runs here, eagerly,
        and one Python call less per token keeps the compiled step at 39 (tests/runtime/test_overhead.py)."""
        if self.graph_exit is not None and torch.compiler.is_compiling():
            return opaque_linear(x, self.graph_exit)
        return packed_linear(x, self.packed, self.bias)


FUSED_DENSE_MAX_TOKENS = 8
"""`FusedLinear` computes calls on up to this many rows with moepager's GEMV, more with torch's GEMM (at 16 rows
torch's catches up)."""


class FusedLinear(LeavesGraph):
    """y = x W^T + b on plain bf16 weights with moepager's own GEMV (accel/cpu_kernels.py) for a few rows: it reads
    a large matrix (an LM head) faster than oneDNN's prepacked kernel or torch's own, and a small one without their
    fixed cost per call (benchmarks/README.md#cpu_kernels). Its fp32 accumulation order differs from torch's: a result
    may differ in its last bf16 bit."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        module = cpu_kernels.extension()
        assert module is not None
        self._gemv = module.linear_bf16
        self.register_buffer("weight", weight.detach().contiguous())  # a tied head shares the embedding's storage
        self.register_buffer("bias", None if bias is None else bias.detach())

    def host_linear(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)  # run by a graph exit, eagerly: `forward` computes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`LeavesGraph.forward` with `host_linear` written out (every projection of a decode step runs here)."""
        if self.graph_exit is not None and torch.compiler.is_compiling():
            return opaque_linear(x, self.graph_exit)
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > FUSED_DENSE_MAX_TOKENS:
            return F.linear(x, self.weight, self.bias)
        y = self._gemv(rows, self.weight)
        return (y if self.bias is None else y + self.bias).view(*x.shape[:-1], self.out_features)


def _packed_if_large(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear | None:
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.numel() < PACK_MIN_ELEMENTS:
        return None
    return PackedLinear(weight, bias)


def _fused_if_bf16(weight: torch.Tensor, bias: torch.Tensor | None) -> FusedLinear | None:
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    return FusedLinear(weight, bias)


def pack_dense(model: nn.Module) -> str:
    """Give the model's bf16 dense projections a faster CPU kernel in place (accel/dense_quant.py's `replace_dense`
    picks them: attention, dense and shared-expert MLPs, the LM head): moepager's GEMV where its extension runs here
    (every size), else oneDNN's prepacked weights for the large ones; says what it did ("" for nothing)."""
    if cpu_kernels.available():
        n = replace_dense(model, _fused_if_bf16)
        return f"{n} projection{'s' if n != 1 else ''} on moepager's CPU GEMV up to {FUSED_DENSE_MAX_TOKENS} rows" \
            if n else ""
    n = replace_dense(model, _packed_if_large) if packing_available() else 0
    return f"{n} large projection{'s' if n != 1 else ''} prepacked for oneDNN" if n else ""


def unfuse_dense(model: CausalLM) -> int:
    """Turn every FusedLinear but the LM head back into a plain nn.Linear on the same weights (a compiled decode step
    traces them inside its graph, where each FusedLinear would be a graph exit: accel/compiled.py); how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, FusedLinear) and child is not model.lm_head:
                with torch.device("meta"):
                    plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                plain.weight = nn.Parameter(child.weight, requires_grad=False)
                if child.bias is not None:
                    plain.bias = nn.Parameter(child.bias, requires_grad=False)
                setattr(module, name, plain)
                count += 1
    return count


def pack_lm_head(model: CausalLM) -> bool:
    """Give only the LM head (tied or not) the faster kernel `pack_dense` would; whether it did. A compiled decode
    step (accel/compiled.py) runs the head after its graph."""
    if cpu_kernels.available():
        return replace_head(model, _fused_if_bf16)
    return packing_available() and replace_head(model, _packed_if_large)
