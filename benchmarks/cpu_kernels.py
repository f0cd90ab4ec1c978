"""moepager's fused CPU expert kernels (accel/cpu_kernels.py) against the torch kernels the executor otherwise runs,
one MoE layer at a time, and each against the machine's streaming read bandwidth.

For each geometry (qwen3-30b-a3b's experts: D=2048, F=768, 128 experts, top-8; the built-in model's: D=256, F=64, 32
experts, top-4), format (bf16; int8 and int4 in groups of 32, the fused kernel with 8-bit activations) and token count,
one layer's routed experts are computed by `ResidentExecutor.run` with the fused kernel and with the torch path
(`loop` for one token, `auto`'s choice for more: grouped for bf16, loop for int8/int4, whose int4 arena is held in
torch's int4pack layout), over fresh random routing each repetition (so a large layer's experts come from RAM, not
the caches); arenas on huge pages, as the engine holds them. Weight GB/s = bytes of the distinct experts a call
reads / its time; `% stream` divides that by the streaming read bandwidth measured by the extension's `stream_read`
over 1 GiB on huge pages at the same thread count.

    python -m benchmarks run cpu_kernels [--threads 1 2] [--tokens 1 4 16 64] [--formats bf16 int8 int4]
        [--geometries qwen3 demo] [--reps 30]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import machine_state, print_table, write_json
from moepager.accel import cpu_kernels
from moepager.experts.executor import ResidentExecutor
from moepager.experts.quant import QuantExpertWeights, QuantFormat, quantize_expert, sections
from moepager.experts.weights import ExpertShape
from moepager.types import RoutingDecision, host_empty

GEOMETRIES = {"qwen3": (2048, 768, 128, 8), "demo": (256, 64, 32, 4)}


def stream_bandwidth(module, nbytes: int = 1 << 30) -> float:
    """Best of 5 reads of 1 GiB on huge pages (as the engine holds its weights: types.py `host_empty`)."""
    buf = host_empty(nbytes, dtype=torch.uint8).fill_(1)
    module.stream_read(buf)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        module.stream_read(buf)
        best = max(best, nbytes / (time.perf_counter() - t0))
    return best


def arena_of(fmt: str, d: int, f: int, e: int, layout: str) -> tuple[torch.Tensor, ExpertShape]:
    gen = torch.Generator().manual_seed(0)
    if fmt == "bf16":
        shape = ExpertShape(d, f, torch.bfloat16)
        arena = host_empty(e, shape.numel, dtype=torch.bfloat16)  # huge pages, as the engine's arenas
        for row in range(e):
            arena[row] = torch.randn(shape.numel, generator=gen) * 0.02
        return arena, shape
    quant = QuantFormat(8) if fmt == "int8" else QuantFormat(4, 32, False, layout)  # type: ignore[arg-type]
    shape = ExpertShape(d, f, torch.bfloat16, quant)
    arena = host_empty(e, sections(d, f, torch.bfloat16, quant)[1], dtype=torch.uint8)
    gate_up, down = torch.randn(2 * f, d, generator=gen) * 0.02, torch.randn(d, f, generator=gen) * 0.02
    for row in range(e):  # one quantized expert copied everywhere would be cached: perturb each
        quantize_expert(gate_up.roll(row, 1), down.roll(row, 0), QuantExpertWeights(arena[row], d, f, torch.bfloat16,
                                                                                     quant), torch.bfloat16)
    return arena, shape


def time_layer(executor: ResidentExecutor, d: int, e: int, k: int, tokens: int, reps: int) -> tuple[float, float]:
    """Median seconds per call and mean distinct experts per call, over fresh random routing."""
    gen = torch.Generator().manual_seed(1)
    routes = []
    for _ in range(reps + 3):
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
        w = torch.softmax(torch.randn(tokens, k, generator=gen), -1).to(torch.bfloat16)
        routes.append((torch.randn(tokens, d, generator=gen).to(torch.bfloat16), RoutingDecision(ids, w, None)))
    times, distinct = [], []
    for i, (x, route) in enumerate(routes):
        t0 = time.perf_counter()
        executor.run(0, x, route)
        if i >= 3:
            times.append(time.perf_counter() - t0)
            distinct.append(len(set(route.ids_TK.flatten().tolist())))
    times.sort()
    return times[len(times) // 2], sum(distinct) / len(distinct)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--formats", nargs="+", default=["bf16", "int8", "int4"])
    ap.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    module = cpu_kernels.extension()
    if module is None:
        print(f"skipped: {cpu_kernels.status()}")
        raise SystemExit(3)
    state = {**machine_state(), "tier": cpu_kernels.tier()}
    print(f"CPU kernels: {cpu_kernels.status()}")
    rows, results, stream = [], [], {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        stream[threads] = stream_bandwidth(module)
    for geometry in args.geometries:
        d, f, e, k = GEOMETRIES[geometry]
        for fmt in args.formats:
            fused_arena, shape = arena_of(fmt, d, f, e, "rows")
            torch_arena, torch_shape = (fused_arena, shape) if fmt != "int4" else arena_of(fmt, d, f, e, "cpu")
            fused = ResidentExecutor(fused_arena, shape, [0], e, "fused", cpu_kernels.FusedExperts(shape, 1 << 62))
            native = ResidentExecutor(torch_arena, torch_shape, [0], e, "auto")
            for threads in args.threads:
                torch.set_num_threads(threads)
                for tokens in args.tokens:
                    t_fused, distinct = time_layer(fused, d, e, k, tokens, args.reps)
                    t_torch, _ = time_layer(native, d, e, k, tokens, args.reps)
                    nbytes = distinct * shape.nbytes
                    gbs_fused, gbs_torch = nbytes / t_fused / 1e9, nbytes / t_torch / 1e9
                    r = {"geometry": geometry, "format": fmt, "threads": threads, "tokens": tokens,
                         "distinct_experts": distinct, "fused_ms": t_fused * 1e3, "torch_ms": t_torch * 1e3,
                         "speedup": t_torch / t_fused, "fused_GBps": gbs_fused, "torch_GBps": gbs_torch,
                         "stream_GBps": stream[threads] / 1e9,
                         "fused_share_of_stream": gbs_fused * 1e9 / stream[threads]}
                    results.append(r)
                    rows.append([geometry, fmt, threads, tokens, f"{t_torch * 1e3:.3f}", f"{t_fused * 1e3:.3f}",
                                 f"{r['speedup']:.2f}x", f"{gbs_torch:.1f}", f"{gbs_fused:.1f}",
                                 f"{100 * r['fused_share_of_stream']:.0f}%"])
                    print(*rows[-1], flush=True)
    print()
    print_table(["geometry", "format", "threads", "tokens", "torch ms", "fused ms", "speedup", "torch GB/s",
                 "fused GB/s", "% stream"], rows)
    print("stream read GB/s: " + ", ".join(f"{t} thread{'s' if t > 1 else ''} {b / 1e9:.1f}"
                                           for t, b in stream.items()))
    write_json("cpu_kernels", {"state": state, "stream_GBps": {t: b / 1e9 for t, b in stream.items()},
                               "rows": results})


if __name__ == "__main__":
    main()
