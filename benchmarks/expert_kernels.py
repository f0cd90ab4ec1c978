"""The candidates the executor and the decode step choose between, measured on this CPU (bf16, 1 thread):
1. one MoE layer's routed experts with each expert kernel (loop / gather / grouped, experts/executor.py) at 1
   and 64 tokens, for the built-in model's experts (D=256, F=64, 32 experts, top-4) and DeepSeek-V2-Lite's
   (D=2048, F=1408, 64 experts, top-6); the arena holds every expert of the layer;
2. one linear layer at one token with oneDNN and with torch's own kernels, and the built-in model's whole
   decode step both ways (what NATIVE_GEMV_MAX_HIDDEN in models/layers.py decides between; the benchmark
   sets it to 0 for the oneDNN runs).
Prints two tables and writes results/expert_kernels.json.

With --formats, instead: one projection of quantized experts (experts/quant.py) against bf16 at 1-256 tokens,
for the qwen3-30b-a3b, DeepSeek-V2-Lite and the built-in model's shapes: bf16 F.linear, int8 with torch's
`_weight_int8pack_mm` and dequantised + F.linear, int4 with `_weight_int4pack_mm_for_cpu`; and the time to
repack one int4 projection into that kernel's layout (what every int4 expert read costs), ours against torch's
op. Writes results/expert_formats.json.

With --step-only [MODEL] [--expert-dtype F]: only the decode-step comparison, on MODEL.

    python benchmarks/expert_kernels.py [--threads 1] [--formats | --step-only [MODEL] [--expert-dtype F]]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import machine_state, median_time, print_table, write_json
from moepager.experts.executor import ArenaKernels, combine
from moepager.experts.quant import (
    QuantExpertWeights,
    QuantFormat,
    pack_int4_cpu,
    pack_nibbles,
    quantize_expert,
    unpack_nibbles,
)
from moepager.experts.sorting import sort_by_expert
from moepager.experts.weights import ExpertShape
from moepager.types import RoutingDecision

GEOMETRIES = {"demo-moe": (256, 64, 32, 4), "deepseek-v2-lite": (2048, 1408, 64, 6)}
LINEARS = [(128, 256), (768, 256), (8192, 256), (2816, 2048), (2048, 1408), (4096, 2048), (151936, 2048)]
"""Expert, attention and LM-head shapes of the built-in model, DeepSeek-V2-Lite and qwen3-30b-a3b (its LM head last)."""


def layer_ms(kernels: ArenaKernels, kernel: str, x: torch.Tensor, route: RoutingDecision, reps: int) -> float:
    def run() -> None:
        work = sort_by_expert(x, route)
        combine(x, work, kernels.compute(work, work.experts, kernel))  # type: ignore[arg-type]
    with torch.inference_mode():
        run()
        return 1e3 * median_time(run, reps)


def linear_us(out_f: int, in_f: int, native: bool, reps: int = 0) -> float:
    reps = reps or (10 if out_f * in_f > 10**8 else 200)
    w, x = torch.randn(out_f, in_f).to(torch.bfloat16), torch.randn(1, in_f).to(torch.bfloat16)
    with torch.inference_mode(), torch.backends.mkldnn.flags(enabled=not native):
        F.linear(x, w)
        return 1e6 * median_time(lambda: F.linear(x, w), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--formats", action="store_true", help="quantized expert projections instead (see above)")
    ap.add_argument("--step-only", metavar="MODEL", nargs="?", const="",
                    help="only the decode step, oneDNN against native, of MODEL (default: the built-in one)")
    ap.add_argument("--expert-dtype", help="with --step-only: the experts' format")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.formats:
        return formats(args.threads)
    if args.step_only is not None:
        step = decode_step_tok_s(model=args.step_only or None, expert_dtype=args.expert_dtype, tokens=32)
        print_table(["decode step", "oneDNN tok/s", "torch native tok/s", "native / oneDNN"],
                    [[args.step_only or "built-in model", step["onednn"], step["native"],
                      step["native"] / step["onednn"]]])
        return None
    gen = torch.Generator().manual_seed(0)
    layers = []
    for name, (d, f, e, k) in GEOMETRIES.items():
        shape = ExpertShape(d, f, torch.bfloat16)
        kernels = ArenaKernels(torch.randn(e, shape.numel, generator=gen).mul_(0.02).to(torch.bfloat16), shape)
        for tokens in (1, 64):
            ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
            route = RoutingDecision(ids, torch.rand(tokens, k, generator=gen), torch.zeros(tokens, e))
            x = torch.randn(tokens, d, generator=gen).to(torch.bfloat16)
            reps = 50 if tokens == 1 or name == "demo-moe" else 5
            row = {"experts": name, "tokens": tokens}
            for kernel in ("loop", "gather", "grouped"):
                slow = kernel == "gather" and tokens > 1 and name != "demo-moe"
                row[f"{kernel}_ms"] = layer_ms(kernels, kernel, x, route, 1 if slow else reps)
            layers.append(row)
    print_table(["experts", "tokens", "loop ms", "gather ms", "grouped ms"],
                [[r["experts"], r["tokens"], r["loop_ms"], r["gather_ms"], r["grouped_ms"]] for r in layers])
    linears = [{"shape": f"{o}x{i}", "onednn_us": linear_us(o, i, False), "native_us": linear_us(o, i, True)}
               for o, i in LINEARS]
    print()
    print_table(["weight (out x in)", "oneDNN us (1 token)", "torch native us"],
                [[r["shape"], r["onednn_us"], r["native_us"]] for r in linears])
    step = decode_step_tok_s()
    print()
    print_table(["built-in model decode", "oneDNN tok/s", "torch native tok/s", "native / oneDNN"],
                [["median of 3 interleaved rounds", step["onednn"], step["native"], step["native"] / step["onednn"]]])
    out = write_json("expert_kernels", {"machine": machine_state(), "threads": args.threads, "layers": layers,
                                        "linears": linears, "decode_step_tok_s": step})
    print(f"wrote {out}")


FORMAT_SHAPES = {"qwen3-30b-a3b": (2048, 768), "deepseek-v2-lite": (2048, 1408), "demo-moe": (256, 64)}


def formats(threads: int) -> None:
    """Per projection (the gate_up one, [2F, D]): microseconds by format and token count, and the int4 repack."""
    rows = []
    for name, (d, f) in FORMAT_SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        gate_up, down = torch.randn(2 * f, d, generator=gen) * 0.02, torch.randn(d, f, generator=gen) * 0.02
        quant = {}
        for label, fmt in (("int8", QuantFormat(8)), ("int4", QuantFormat(4, 32))):
            shape = ExpertShape(d, f, torch.bfloat16, fmt)
            w = QuantExpertWeights(torch.empty(shape.numel, dtype=torch.uint8), d, f, torch.bfloat16, fmt)
            quantize_expert(gate_up, down, w, torch.bfloat16)
            quant[label] = w
        w_bf16, w8 = gate_up.to(torch.bfloat16), quant["int8"]
        q4 = torch.randint(0, 16, (2 * f, d), dtype=torch.uint8, generator=gen)
        plain = pack_nibbles(q4)
        repack_us = 1e6 * median_time(lambda: pack_int4_cpu(plain), 20)
        torch_op_us = 1e6 * median_time(
            lambda: torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(plain).to(torch.int32), 1), 5)
        for tokens in (1, 16, 64, 256):
            x = torch.randn(tokens, d, generator=gen).to(torch.bfloat16)
            reps = 100 if tokens <= 16 else 10
            with torch.inference_mode():
                row = {"shape": f"{name} gate_up {2 * f}x{d}", "tokens": tokens,
                       "bf16_us": 1e6 * median_time(lambda: F.linear(x, w_bf16), reps),
                       "int8_packed_us": 1e6 * median_time(
                           lambda: torch.ops.aten._weight_int8pack_mm(x, w8.q_gate_up, w8.s_gate_up), reps),
                       "int8_dequant_us": 1e6 * median_time(
                           lambda: F.linear(x, w8.q_gate_up.to(x.dtype) * w8.s_gate_up[:, None]), reps),
                       "int4_packed_us": 1e6 * median_time(lambda: quant["int4"].gate_up(x), reps),
                       "int4_repack_us": repack_us, "int4_repack_torch_op_us": torch_op_us}
            rows.append(row)
    print_table(["projection", "tokens", "bf16 us", "int8 packed us", "int8 dequant+GEMM us", "int4 packed us",
                 "int4 repack us (per read)", "torch's repack op us"],
                [[r["shape"], r["tokens"], r["bf16_us"], r["int8_packed_us"], r["int8_dequant_us"],
                  r["int4_packed_us"], r["int4_repack_us"], r["int4_repack_torch_op_us"]] for r in rows])
    out = write_json("expert_formats", {"machine": machine_state(), "threads": threads, "rows": rows})
    print(f"wrote {out}")


def decode_step_tok_s(rounds: int = 3, model: str | None = None, expert_dtype: str | None = None,
                      tokens: int = 64) -> dict[str, float]:
    """A model's decode tok/s (default: the built-in one) with one-token forwards on oneDNN and on torch's own
    kernels, interleaved."""
    import statistics

    from moepager.config import EngineConfig, ExpertFormat
    from moepager.models import layers
    from moepager.runtime.llm import LLM
    from moepager.runtime.sampling import SamplingParams

    llm = LLM(config=EngineConfig(model=model, experts=ExpertFormat(expert_dtype)), show_progress=False)
    params = SamplingParams(max_tokens=tokens + 1, ignore_eos=True)
    prompt = "The history of" if model is None else [list(range(100, 116))]  # other models: any 16 token ids
    default, runs = layers.NATIVE_GEMV_MAX_HIDDEN, {"onednn": [], "native": []}
    try:
        for _ in range(rounds):
            for label, limit in (("onednn", 0), ("native", default)):
                layers.NATIVE_GEMV_MAX_HIDDEN = limit
                llm.generate(prompt, params)
                runs[label].append(llm.last_stats.decode_tokens_per_s)
    finally:
        layers.NATIVE_GEMV_MAX_HIDDEN = default
    return {label: statistics.median(v) for label, v in runs.items()}


if __name__ == "__main__":
    main()
