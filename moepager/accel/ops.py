"""One tier's CPU kernels as torch.library operators, and the named expert format they take.

Each tier's build (accel/cpu_kernels.py) registers its operators and classes in a namespace of its own
(csrc/bind.h: `torch.ops.moepager_cpu_avx2.moe_resident`, `torch.classes.moepager_cpu_avx2.DecodeLayer`), so every
tier can be loaded in one process. Their schemas name every argument (csrc/moe.cpp, csrc/step.cpp); an expert format
is `FormatSpec`'s fields as keyword-only arguments of the same names (csrc/bind.h `MOEPAGER_FORMAT_SCHEMA`), which
callers pass by name (`**spec._asdict()`): a field missing, misnamed or not an int is the dispatcher's error, a format
the kernels cannot compute the kernel's. (Not one script object: torch looks for `__torch_function__` on every
non-tensor argument of an operator call, and on a script object that lookup raises and catches a C++ exception,
which costs more than the call: docs/performance-notes.md.) Every operator returning tensors has a fake
kernel but those taking a format, so a compiled graph can hold it; those run where a compiled step leaves its graph
(models/graph_exit.py), eagerly. A call releases the GIL while it computes (torch's operator call does), so the store's
loader threads run meanwhile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from moepager.experts.quant import sections
from moepager.experts.weights import ExpertShape

FORMAT_CODES = {"bf16": 0, "int8": 1, "int4": 2}
"""An expert format's code in `FormatSpec.fmt` (csrc/rows.h `Format`)."""


class FormatSpec(NamedTuple):
    """An expert format as the kernels read it: csrc/rows.h `Spec`, whose fields the operators take by these names
    (`**spec._asdict()`), and check (a format they do not know, a bad size or int4 group is an error)."""

    fmt: int
    """FORMAT_CODES: bf16, int8 or int4 (the "rows" layout)."""
    hidden: int
    intermediate: int
    group: int
    """int4: inputs a scale covers (32, 64 or 128); else 0."""
    gate_up: int
    """Byte offset of the gate and up rows in an expert's flat buffer (experts/weights.py, experts/quant.py)."""
    down: int
    """Byte offset of the down rows."""
    gate_up_scales: int
    """Byte offset of the gate and up rows' scales (quantized formats; else 0)."""
    down_scales: int
    """Byte offset of the down rows' scales (quantized formats; else 0)."""

    @classmethod
    def of(cls, shape: ExpertShape) -> FormatSpec:
        d, f = shape.hidden, shape.intermediate
        if shape.quant is None:
            return cls(FORMAT_CODES["bf16"], d, f, 0, 0, 2 * f * d * 2, 0, 0)
        gate_up, down, gate_up_scales, down_scales = (s.offset for s in sections(d, f, shape.dtype, shape.quant)[0])
        return cls(FORMAT_CODES["int8" if shape.quant.bits == 8 else "int4"], d, f, shape.quant.group, gate_up, down,
                   gate_up_scales, down_scales)


class Kernels:
    """One tier's loaded operators and classes, under the names callers use. The attributes are the operators'
    overloads themselves (no Python between a caller and the dispatcher)."""

    def __init__(self, namespace: str, path: str):
        """`namespace`: the tier's (accel/cpu_tiers.py `Tier.module_name`); `path`: its library, already loaded."""
        ops = getattr(torch.ops, namespace)
        classes = getattr(torch.classes, namespace)
        self.namespace, self.path = namespace, path
        self.tier: str = ops.tier.default()
        self.selftest: Callable[[], int] = ops.selftest.default
        self.stream_read: Callable[[torch.Tensor], int] = ops.stream_read.default
        self.moe_partial: Callable[..., None] = ops.moe_partial.default
        self.moe_combine: Callable[..., torch.Tensor] = ops.moe_combine.default
        self.moe_resident: Callable[..., torch.Tensor] = ops.moe_resident.default
        self.linear_bf16: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = ops.linear_bf16.default
        self.linear_int8: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = ops.linear_int8.default
        self.greedy_rows: Callable[[torch.Tensor], torch.Tensor] = ops.greedy_rows.default
        self.router_topk: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = ops.router_topk.default
        self.rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = ops.rms_norm.default
        self.decode_attention: Callable[..., torch.Tensor] = ops.decode_attention.default
        self.DecodeLayer: Callable[..., torch.ScriptObject] = classes.DecodeLayer
        """A decoder layer's decode pass bound once (accel/step.py): constructed by name, called with `run`."""
        self.DecodeModel: Callable[..., torch.ScriptObject] = classes.DecodeModel
        """A whole decode pass bound once (accel/step.py): constructed by name, called with `run`."""
        _register_fakes(namespace)

    def __repr__(self) -> str:
        return f"Kernels({self.namespace!r})"


@functools.cache
def _register_fakes(namespace: str) -> None:
    """The fake kernels of a namespace's tensor operators (once per process: a library is loaded once)."""
    def fake(name: str) -> Callable[[Callable[..., object]], object]:
        return lambda fn: torch.library.register_fake(f"{namespace}::{name}", fn)

    @fake("rms_norm")
    def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @fake("router_topk")
    def _router_topk(x: torch.Tensor, w: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, ...]:
        n, e = x.shape[0], w.shape[0]
        return (x.new_empty((n, k), dtype=torch.long), x.new_empty((n, k), dtype=torch.float32),
                x.new_empty((n, e), dtype=torch.float32))

    @fake("linear_bf16")
    def _linear_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], w.shape[0]))

    @fake("linear_int8")
    def _linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], q.shape[0]))

    @fake("moe_combine")
    def _moe_combine(y: torch.Tensor, token: torch.Tensor, n: int) -> torch.Tensor:
        return y.new_empty((n, y.shape[1]), dtype=torch.bfloat16)

    @fake("greedy_rows")
    def _greedy_rows(logits: torch.Tensor) -> torch.Tensor:
        return logits.new_empty((2, logits.shape[0]), dtype=torch.long)

    @fake("decode_attention")
    def _decode_attention(qkv: torch.Tensor, qk_w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                          cache: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, heads: int, window: int,
                          scale: float) -> torch.Tensor:
        return qkv.new_empty((qkv.shape[0], heads * cache.shape[3]))
