"""One-token projections on this CPU: how fast torch's kernels read a weight matrix at decode (x is [1, K]).

Kernels, per matrix shape: bf16 `F.linear` on torch's native GEMV (oneDNN disabled, what a one-token moepager
forward uses), bf16 `F.linear` through oneDNN, oneDNN with the weight prepacked once (`mkldnn._reorder_linear_weight`
+ `_linear_pointwise`; checked bit-equal to `F.linear`), and int8 `_weight_int8pack_mm` (per-channel scales:
moepager's int8 experts and `--dense-dtype int8`). Each time is the best of 5 passes over enough distinct matrices
(~1 GB) that none is served from cache; GB/s counts the weight bytes of each format. Shapes: the built-in model's
fused q/k/v, o_proj, LM head and an expert projection, and qwen3-30b-a3b's fused q/k/v, o_proj, expert
projections and LM head.

    python benchmarks/gemv.py [--threads 1 2] [--out gemv]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import machine_state, print_table, write_json
from moepager.experts.onednn import packed_linear, prepack
from moepager.experts.quant import quantize_int8

SHAPES = [(512, 256), (256, 256), (8192, 256), (128, 256), (5120, 2048), (2048, 4096), (1536, 2048), (2048, 768),
          (151936, 2048)]
TOTAL_BYTES = 1e9


def best_us(fn: Callable[[object], object], weights: list, native: bool) -> float:
    torch._C._set_mkldnn_enabled(not native)
    try:
        for w in weights[:2]:
            fn(w)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for w in weights:
                fn(w)
            best = min(best, (time.perf_counter() - start) / len(weights))
    finally:
        torch._C._set_mkldnn_enabled(True)
    return best * 1e6


def measure(n: int, k: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).bfloat16() for _ in range(max(1, int(TOTAL_BYTES // (n * k * 2))))]
    packed = [prepack(w) for w in weights]
    int8 = [quantize_int8(w, torch.bfloat16) for w in weights]
    x = torch.randn(1, k, generator=gen).bfloat16()

    equal = torch.equal(packed_linear(x, packed[0]), F.linear(x, weights[0]))
    us = {"bf16 native": best_us(lambda w: F.linear(x, w), weights, True),
          "bf16 oneDNN": best_us(lambda w: F.linear(x, w), weights, False),
          "bf16 oneDNN prepacked": best_us(lambda w: packed_linear(x, w), packed, False),
          "int8 packed": best_us(lambda qs: torch.ops.aten._weight_int8pack_mm(x, *qs), int8, True)}
    nbytes = {label: n * k * (1 if label.startswith("int8") else 2) for label in us}
    return {"shape": [n, k], "us": us, "GBps": {label: nbytes[label] / t / 1e3 for label, t in us.items()},
            "prepacked_equal": equal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default="gemv")
    args = ap.parse_args()
    state, results, rows = machine_state(), [], []
    with torch.inference_mode():
        for threads in args.threads:
            torch.set_num_threads(threads)
            for n, k in SHAPES:
                r = measure(n, k) | {"threads": threads}
                results.append(r)
                rows.append([threads, f"{n}x{k}", *(f"{r['us'][c]:.1f} ({r['GBps'][c]:.1f})" for c in r["us"]),
                             r["prepacked_equal"]])
    print_table(["threads", "N x K", "bf16 native us (GB/s)", "bf16 oneDNN", "bf16 oneDNN prepacked", "int8 packed",
                 "prepacked == F.linear"], rows)
    print(f"\nwrote {write_json(args.out, {'machine': state, 'results': results})}")


if __name__ == "__main__":
    main()
