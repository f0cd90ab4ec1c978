"""oneDNN's prepacked bf16 matrix-vector kernel on the CPU: a weight laid out once, at load, in the blocked format
oneDNN's bf16 kernels read (AVX512-BF16 dot products where the CPU has them), so no call converts or reorders it.
The dense projections (accel/packed.py) and the opt-in `packed` expert kernel (experts/executor.py) use it; the
measurements that decide where are in accel/packed.py and `python benchmarks/gemv.py`.

Whether it runs is decided by a tiny call, once per process: torch builds ship the op on every x86 CPU, but oneDNN's
bf16 reorder needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT and raises on anything less (AMD Zen 3: "bf16 path needs
the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"). Where it cannot, callers keep plain weights.
"""

from __future__ import annotations

import sys
from functools import lru_cache

import torch


def _has_ops() -> bool:
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight") and hasattr(
        ops, "_linear_pointwise")


@lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why oneDNN's prepacked bf16 kernel cannot run in this process (None: it can), from a 16x32 call."""
    if not _has_ops():
        return "this torch build has no oneDNN prepacked linear ops"
    try:
        w = torch.ones(16, 32, dtype=torch.bfloat16)
        y = packed_linear(torch.ones(1, 32, dtype=torch.bfloat16), prepack(w))
    except RuntimeError as e:
        return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    if y.shape != (1, 16) or not bool((y.float() == 32).all()):
        return "its 16x32 probe computed the wrong values"
    return None


_said: list[str] = []  # the reason, once said


def packing_available() -> bool:
    """Whether oneDNN's prepacked bf16 linear runs here (the ops exist and a tiny call computes the right values); said
    once per process on stderr when the ops exist but the CPU cannot run them."""
    reason = unavailable_reason()
    if reason is not None and _has_ops() and not _said:
        _said.append(reason)
        print(f"moepager: oneDNN's prepacked bf16 kernel is unavailable, keeping plain weights: {reason}",
              file=sys.stderr)
    return reason is None


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] in oneDNN's layout for one-token calls (an opaque oneDNN tensor, a copy)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for W prepacked by `prepack` (any leading dimensions of x)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
