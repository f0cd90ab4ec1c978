"""Hybrid CPU/GPU expert execution (`--execution`): measured where a GPU is, modeled on every real trace.

Measured (one run, each mode a fresh engine, the same replayed requests): `gpu` (every miss copied to the device),
`hybrid` (misses computed on the CPU unless the cost model says the copy pays), `hybrid+admit1` (`--hybrid-admit 1`)
and `cpu-experts` (every routed expert on the CPU: llama.cpp's --cpu-moe), at one device budget.
- With CUDA (`--device cuda`): the DeepSeek-V2-Lite geometry (`--layers` MoE layers; the one geometry we have real
  routing for) replaying the DeepSeek-V2-Lite trace: decode TPOT over `--decode` steps after a `--prompt`-token
  prompt, and TTFT of a `--ttft-prompt`-token prompt, each mode's ratio to `gpu`.
- Without (`--device cpu`, the quick suite): the built-in model generating from the corpus, the 'device' side on the
  CPU too: the data path's cost and the tokens, which must equal the all-resident run's (timings say nothing of a
  GPU's).
Modeled (`moepager simulate`'s cost model, warm start, LRFU): decode TPOT, TTFT at `--ttft-prompt` tokens and
bytes per token of gpu, hybrid and hybrid+admit1 on the DeepSeek-V2-Lite and Mixtral traces and the built-in model's
recording, at 12.5/25/50%, for each `--profiles` (nominal GPU profiles; this project's 2-core CPU as the CPU side
unless a calibrated profile measured one).

    python -m benchmarks.hybrid [--device cuda] [--layers 8] [--budget 25%] [--profiles h100-pcie5 rtx4090-pcie4]
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    RESULTS,
    SHARED,
    converted,
    demo_documents,
    ensure_model,
    machine_state,
    print_table,
    record_demo_trace,
    write_json,
)
from moepager.config import EngineConfig, PlacementConfig, StoreConfig
from moepager.planning.cost import CostModel
from moepager.runtime.llm import LLM
from moepager.runtime.replay import ReplaySpec
from moepager.runtime.sampling import SamplingParams
from moepager.trace.format import TraceReader
from moepager.trace.report import summary
from moepager.trace.simulate import SimSpec, simulate
from moepager.trace.workload import Cut, load_workload

MODES: dict[str, dict[str, Any]] = {
    "gpu": {"execution": "gpu"},
    "hybrid": {"execution": "hybrid"},
    "hybrid+admit1": {"execution": "hybrid", "hybrid_admit": 1},
    "cpu-experts": {"execution": "cpu-experts"},
}


def arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=8, help="CUDA: MoE layers of the DeepSeek-V2-Lite geometry")
    p.add_argument("--budget", default="25%", help="device expert budget (--expert-memory)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--requests", type=int, default=2, help="CUDA: replayed requests")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--ttft-prompt", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--profiles", nargs="+", default=["h100-pcie5", "rtx4090-pcie4", "h100-pcie3"])
    p.add_argument("--sim-requests", type=int, default=40, help="requests of each trace the model replays")
    p.add_argument("--no-model", action="store_true", help="the measured part only")
    return p


def measured_cuda(args: argparse.Namespace) -> list[dict]:
    from benchmarks.offload_replay import deepseek_trace, replayed_requests, replayed_run

    path = ensure_model(f"deepseek-v2-lite-L{args.layers + 1}", "deepseek-v2-lite", args.layers + 1)
    trace = deepseek_trace(args.layers)
    decode = ReplaySpec(trace, replayed_requests(trace, 200, args.requests, args.prompt + args.decode),
                        args.prompt, "match", args.decode)
    prefill = ReplaySpec(trace, replayed_requests(trace, 200, 1, args.ttft_prompt + 1), args.ttft_prompt, "match", 0)
    rows = []
    for mode in args.modes:
        row: dict[str, Any] = {"mode": mode}
        for what, spec in (("decode", decode), ("prefill", prefill)):
            llm = LLM(config=engine(path, args, mode), show_progress=False)
            got = replayed_run(llm, spec, args.layers, times=2 if what == "prefill" else 1)
            if what == "decode":
                row |= {k: got[k] for k in ("tpot_ms", "decode_tok_s", "hit_rate", "h2d_MiB_per_token")}
            else:
                row["ttft_ms"] = got["ttft_ms"]
        rows.append(row)
    return ratios(rows)


def engine(path: Path | None, args: argparse.Namespace, mode: str) -> EngineConfig:
    store = StoreConfig() if mode == "cpu-experts" else StoreConfig(expert_memory=args.budget)
    return EngineConfig(model=None if path is None else str(path), device=args.device, threads=args.threads,
                        store=store, placement=PlacementConfig(**MODES[mode]))


def measured_cpu(args: argparse.Namespace) -> list[dict]:
    """The built-in model with its 'device' on the CPU: every mode's tokens against the all-resident run's."""
    docs, _ = demo_documents()
    prompts = [d[:200] for d in docs[:2]]
    params = SamplingParams(max_tokens=args.decode, ignore_eos=True)
    reference = LLM(threads=args.threads, show_progress=False).generate(prompts, params)
    rows = []
    for mode in args.modes:
        llm = LLM(config=engine(None, args, mode), show_progress=False)
        out = llm.generate(prompts, params)
        s = llm.last_stats
        experts = s.sections["experts"].to_dict().get("decode", {})
        rows.append({"mode": mode, "tpot_ms": 1e3 * s.tpot_median_s, "ttft_ms": 1e3 * s.ttft_s,
                     "hit_rate": experts.get("hit_rate", 1.0),
                     "on_cpu_per_token": experts.get("computed_on_cpu", 0) / max(experts.get("tokens", 1), 1),
                     "same_tokens": [o.token_ids for o in out] == [r.token_ids for r in reference]})
        del llm
        gc.collect()
    if not all(r["same_tokens"] for r in rows):
        raise SystemExit("a mode's tokens differ from the all-resident run's")
    return rows  # no ratios: here gpu pages from disk, hybrid and cpu-experts hold every expert in RAM


def ratios(rows: list[dict]) -> list[dict]:
    base = next((r for r in rows if r["mode"] == "gpu"), None)
    for r in rows:
        if base is not None:
            r["decode_speedup"] = base["tpot_ms"] / r["tpot_ms"] if r.get("tpot_ms") else None
            r["ttft_speedup"] = base["ttft_ms"] / r["ttft_ms"] if r.get("ttft_ms") else None
    return rows


def traces(args: argparse.Namespace) -> dict[str, tuple[Path, Cut | None]]:
    """Each trace and how its requests are cut into a prompt and decode steps (None: as recorded)."""
    out: dict[str, tuple[Path, Cut | None]] = {}
    if (SHARED / "deepseek-v2-lite").exists() or (RESULTS / "traces" / "deepseek-v2-lite.mpt").exists():
        out["deepseek-v2-lite"] = (converted("deepseek-csv", SHARED / "deepseek-v2-lite", "deepseek-v2-lite"),
                                   Cut(args.prompt, args.decode))
    if (SHARED / "mixtral-8x7b").exists() or (RESULTS / "traces" / "mixtral-8x7b.mpt").exists():
        out["mixtral-8x7b"] = (converted("mixtral-jsonl", SHARED / "mixtral-8x7b" / "routing_data_collected",
                                         "mixtral-8x7b"), None)
    docs, _ = demo_documents()
    out["built-in"] = (record_demo_trace(RESULTS / "traces" / "demo-hybrid.mpt", docs[:48], 64, max_new=24), None)
    return out


def long_enough(path: Path, cut: Cut | None, count: int) -> list[int]:
    """The first `count` requests with the tokens `cut` keeps."""
    need = 0 if cut is None else (cut.prompt_tokens or 0) + max(cut.decode_steps or 0, 0)
    with TraceReader(path) as reader:
        return [i for i in range(len(reader)) if reader.request(i).num_tokens >= need][:count]


def modeled(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name, (path, cut) in traces(args).items():
        chosen = long_enough(path, cut, args.sim_requests)
        work = load_workload(str(path), "recorded", requests=chosen, cut=cut or Cut())
        h = work.header
        for profile in args.profiles:
            cost = CostModel.profile(profile, h.expert_bytes, num_shared=h.num_shared)
            device_tokens = cost.expert_times(on_cpu=cost.device_is_cpu).threshold()
            done: set[int] = set()
            for share in (0.125, 0.25, 0.5):
                per_layer = max(h.top_k, round(share * h.num_experts))
                if per_layer in done:  # Mixtral: 12.5% of 8 experts is below its top-2, the same cache as 25%
                    continue
                done.add(per_layer)
                for label, spec in (("gpu", SimSpec("lrfu", per_layer, warm=True)),
                                    ("hybrid", SimSpec("lrfu", per_layer, warm=True, execution="hybrid",
                                                       device_tokens=device_tokens)),
                                    ("hybrid+admit1", SimSpec("lrfu", per_layer, warm=True, execution="hybrid",
                                                              device_tokens=device_tokens, admit=1))):
                    row = summary(simulate(work, spec), work, cost)
                    rows.append({"trace": name, "profile": profile, "budget": f"{100 * share:g}%", "mode": label,
                                 "per_layer": per_layer, "tpot_ms": row["tpot_ms"], "ttft_ms": row["ttft_ms"],
                                 "decode_hit_rate": row["decode_hit_rate"],
                                 "MiB_per_token": row.get("bytes_per_token", 0) / 2**20,
                                 "on_cpu_per_token": row["on_cpu_per_token"], "device_tokens": device_tokens})
    for r in rows:  # each row against gpu at its trace, profile and budget
        base = next(b for b in rows if (b["trace"], b["profile"], b["budget"], b["mode"])
                    == (r["trace"], r["profile"], r["budget"], "gpu"))
        r["tpot_speedup"] = base["tpot_ms"] / r["tpot_ms"] if r["tpot_ms"] else None
    return rows


def main() -> None:
    args = arguments().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    state = machine_state()
    measured = measured_cuda(args) if args.device.startswith("cuda") else measured_cpu(args)
    what = "the built-in model, the device side on the CPU" if args.device == "cpu" else \
        "DeepSeek-V2-Lite geometry, replayed routing"
    print(f"measured on {args.device} ({what}), budget {args.budget}:")
    print_table(["mode", "TPOT ms", "x gpu", "TTFT ms", "x gpu", "hit %"],
                [[r["mode"], r["tpot_ms"], r.get("decode_speedup", "-"), r["ttft_ms"], r.get("ttft_speedup", "-"),
                  100 * r["hit_rate"]] for r in measured])
    model_rows = [] if args.no_model else modeled(args)
    if model_rows:
        print("\nmodeled (simulate's cost model, LRFU, warm start):")
        print_table(["trace", "profile", "budget", "mode", "TPOT ms", "x gpu", "MiB/token", "CPU experts/token",
                     "hit %"],
                    [[r["trace"], r["profile"], r["budget"], r["mode"], r["tpot_ms"], r["tpot_speedup"],
                      r["MiB_per_token"], r["on_cpu_per_token"], 100 * r["decode_hit_rate"]] for r in model_rows])
    out = write_json("hybrid", {"machine": state, "args": vars(args), "measured": measured, "modeled": model_rows})
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
