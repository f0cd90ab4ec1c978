"""Paged experts at the same byte budget: bf16 against int8 and int4 experts, on replayed DeepSeek-V2-Lite routing.

The deepseek-v2-lite-geometry checkpoint of benchmarks/offload_cpu.py (8 MoE layers; int8/int4 from its
`moepager quantize` copies, so disk reads are quantized bytes), the same replayed requests
(--route-prompt: the first --prompt tokens are the prompt, every later token a decode step), LRU, experts read
with O_DIRECT. Each budget is a byte count: a fraction of the *bf16* experts' bytes, so a quantized run holds
2x (int8) or ~3.2x (int4, groups of 32 with bf16 scales) as many experts in it. Prints hit rate, decode tok/s,
TPOT and disk bytes per token per format, and the ratios to bf16 at each budget.

    python benchmarks/quant_paged.py [--layers 8] [--threads 2] [--requests 2] [--prompt 16] [--decode 48]
        [--fractions 0.25 0.125] [--formats bf16 int8 int4]
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from benchmarks.common import ensure_model, machine_state, print_table, write_json
from benchmarks.offload_replay import deepseek_trace, quantized, replayed_requests, replayed_run
from moepager.config import EngineConfig, StoreConfig
from moepager.runtime.llm import LLM
from moepager.runtime.replay import ReplaySpec


def run(path: Path, fmt: str, budget_bytes: int | None, spec: ReplaySpec, args: argparse.Namespace) -> dict:
    store = StoreConfig(expert_memory=str(budget_bytes), policy="lru", io_threads=args.io_threads) if budget_bytes \
        else StoreConfig()
    llm = LLM(config=EngineConfig(model=str(quantized(path, fmt)), threads=args.threads, store=store),
              show_progress=False)
    return {"format": fmt} | replayed_run(llm, spec, args.layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--fit-requests", type=int, default=1500, help="requests skipped (as offload_cpu.py fits on them)")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.125],
                    help="budgets as fractions of all bf16 experts' bytes")
    ap.add_argument("--formats", nargs="+", default=["bf16", "int8", "int4"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    state = machine_state()
    path = ensure_model(f"deepseek-v2-lite-L{args.layers + 1}", "deepseek-v2-lite", args.layers + 1)
    trace = deepseek_trace(args.layers)
    requests = replayed_requests(trace, args.fit_requests, args.requests, args.prompt + args.decode)
    spec = ReplaySpec(trace, requests, args.prompt, "match", args.decode)
    probe = LLM(path, show_progress=False)
    cfg, bf16_bytes = probe.loaded.config, probe.loaded.expert_shape.nbytes
    all_bytes = cfg.num_moe_layers * cfg.num_experts * bf16_bytes
    del probe
    gc.collect()
    rows = []
    for fraction in args.fractions:
        for fmt in args.formats:
            r = run(path, fmt, int(all_bytes * fraction), spec, args)
            rows.append(r | {"budget": f"{fraction:.1%} of bf16 ({all_bytes * fraction / 2**30:.2f} GiB)"})
            print(rows[-1])
    for r in rows:
        base = next(b for b in rows if b["budget"] == r["budget"] and b["format"] == "bf16")
        r["tok_s_vs_bf16"] = r["decode_tok_s"] / base["decode_tok_s"]
    print_table(["budget", "format", "slots", "hit rate", "decode tok/s", "x bf16", "TPOT ms", "disk MiB/token"],
                [[r["budget"], r["format"], r["slots"], f"{r['hit_rate']:.3f}", r["decode_tok_s"],
                  f"{r['tok_s_vs_bf16']:.2f}", r["tpot_ms"], r["disk_MiB_per_token"]] for r in rows])
    out = write_json("quant_paged", {"machine": state, "model": str(path), "trace": str(trace),
                                     "replayed_requests": requests, "args": vars(args), "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
