"""Weight-only int8 for the dense part of a model (`--dense-dtype int8`; lossy, opt-in): attention projections,
dense and shared-expert MLPs and the LM head become int8 weights with one scale per output channel, the same
format and kernels as int8 routed experts (experts/quant.py: w = q * scale[row], scale = absmax(row) / 127;
`_weight_int8pack_mm` at a few tokens on the CPU, dequantise + GEMM otherwise).

What stays in the run's dtype: routers (and Qwen2-MoE's shared-expert gate: one output each, they decide which
experts run), norms, embeddings, and MLA's kv_b_proj (used as a matrix, not as a projection: the absorbed
attention multiplies it into the queries). A tied LM head gets its own int8 copy; the embedding keeps its
weights for the lookup.

Bytes and speed (`python -m benchmarks run gemv`: `aten._weight_int8pack_mm` against bf16 `F.linear`): small matrices
run faster, large ones (K of 2048 and more) gain little, that kernel reading int8 at about half bf16's rate (the same
time for half the bytes). Memory halves either way. `--dense-dtype int8-a8` quantizes the activations too and runs
moepager's int8 GEMV (accel/cpu_kernels.py, activations in blocks of 32 with a scale each) for bf16 runs where it is
built, else FBGEMM (activations with one scale per row) (Int8A8Linear): faster on large matrices, lossier.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moepager.accel import cpu_kernels
from moepager.config import check_dense_name
from moepager.errors import ConfigError
from moepager.experts.quant import int8_mm, int8_packed_mm, int8_packing_available, int8_prepack, quantize_int8
from moepager.models.attention import Attention
from moepager.models.graph_exit import LeavesGraph
from moepager.models.layers import CausalLM

KEEP = ("kv_b_proj", "shared_expert_gate")
"""nn.Linear modules left in the run's dtype (see the module note)."""


def check_dense_dtype(dense_dtype: str | None, device: torch.device | str | None = None) -> None:
    check_dense_name(dense_dtype)
    if dense_dtype == "int8-a8" and (device is not None and torch.device(device).type != "cpu"
                                     or not (int8_packing_available() or cpu_kernels.available())):
        raise ConfigError("--dense-dtype int8-a8 computes with FBGEMM on the CPU (not available here); use "
                          "--dense-dtype int8")


class _RowsLinear(LeavesGraph):
    """A projection computed on x flattened to rows by a subclass's `rows_mm`, reshaped back, plus the bias."""

    out_features: int
    bias: torch.Tensor | None

    def rows_mm(self, x_TK: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def host_linear(self, x: torch.Tensor) -> torch.Tensor:
        y = self.rows_mm(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8Linear(_RowsLinear):
    """A projection y = x (q * scale)^T + bias with int8 q [N, K] and one scale per output row in x's dtype."""

    opaque_weights = False  # plain int8 tensors and an aten kernel: a compiled graph traces it

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        q, scale = quantize_int8(weight, weight.dtype)  # on the weight's device
        self.out_features = q.shape[0]
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach())

    def rows_mm(self, x_TK: torch.Tensor) -> torch.Tensor:
        return int8_mm(x_TK, self.q, self.scale)


class Int8A8Linear(_RowsLinear):
    """`--dense-dtype int8-a8` (CPU; lossier than int8, opt-in): the same int8 weights prepacked for FBGEMM and
    computed with each token's activations quantized to 8 bits (experts/quant.py's int8_packed_mm), which reads
    int8 at up to twice the rate of `_weight_int8pack_mm` on large matrices (see experts/quant.py). The integer
    weights are not kept beside the packed ones."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        q, scale = quantize_int8(weight, weight.dtype)
        self.out_features, self.in_features = q.shape
        module = cpu_kernels.extension() if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" else None
        self._ours = None if module is None else module.linear_int8
        """moepager's int8 GEMV (accel/cpu_kernels.py; activations in blocks of 32) where it runs, else FBGEMM."""
        if self._ours is not None:
            self.register_buffer("q", q)
            self.register_buffer("scale", scale)
        else:
            self.packed = int8_prepack(q, scale)
        self.register_buffer("bias", None if bias is None else bias.detach())

    def rows_mm(self, x_TK: torch.Tensor) -> torch.Tensor:
        if self._ours is not None:
            return self._ours(x_TK, self.q, self.scale)
        return int8_packed_mm(x_TK, self.packed)


Make = Callable[[torch.Tensor, "torch.Tensor | None"], "nn.Module | None"]
"""A dense projection's replacement from its (weight, bias), or None to keep it as it is."""


def replace_dense(model: nn.Module, make: Make) -> int:
    """Replace the model's dense projections (attention, dense and shared-expert MLPs, the LM head; not those in
    KEEP) by `make(weight, bias)` in place; returns how many were replaced. Attention's q/k/v are replaced as their
    one fused projection (the three modules are then dropped); a tied LM head gets its own module (the embedding
    keeps its weights)."""
    replaced = 0
    for module in list(model.modules()):
        if isinstance(module, Attention) and module.qkv is None:
            fused = make(*module.fused_qkv())
            if fused is not None:
                module.replace_qkv(fused)
                replaced += 1
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name not in KEEP:
                new = make(child.weight, child.bias)
                if new is not None:
                    setattr(module, name, new)
                    replaced += 1
    if isinstance(model, CausalLM) and model.lm_head is None:
        replaced += replace_head(model, make)
    return replaced


def replace_head(model: CausalLM, make: Make) -> bool:
    """Replace the LM head alone by `make(weight, bias)` (a tied head gets its own module, the embedding keeps its
    weights); whether it did. A head already replaced stays as it is."""
    head = model.lm_head
    if head is None:
        new = make(model.model.embed_tokens.weight, None)
    elif isinstance(head, nn.Linear):
        new = make(head.weight, head.bias)
    else:
        return False
    if new is not None:
        model.lm_head = new
    return new is not None


def quantize_dense(model: nn.Module, dense_dtype: str = "int8") -> None:
    """Replace the model's dense projections by Int8Linear (or Int8A8Linear) in place (`replace_dense`)."""
    replace_dense(model, Int8A8Linear if dense_dtype == "int8-a8" else Int8Linear)
