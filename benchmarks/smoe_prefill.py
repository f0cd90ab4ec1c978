"""SMoE's prefill (SMoE §2.3-2.4): does sending a long prompt's heavy experts through two ping-pong rows, the decode
cache left alone and then filled with the prompt's most activated experts, beat copying them through the cache,
copying every expert, and computing every miss on the CPU? TTFT at 512- and 1,024-token prompts at 3-12% budgets,
the share of the prompt's experts sent to the device, and the decode that follows.

Modes (`--execution`, `--hybrid-prefill`):
- `cpu`: nothing copied; the modeled one computes every miss on the CPU (hybrid with no expert heavy enough, the
  cache as warmed), the measured one is `--execution cpu-experts` (every routed expert on the CPU: kTransformers'
  and llama.cpp's --cpu-moe prefill, SMoE's baseline);
- `gpu`: every routed expert computed on the device, a miss copied in through the cache (needs slots >= top-k in
  the simulator; the engine streams the rest through its rows);
- `hybrid-cache`: SMoE's placement rule (Algorithm 1), the heavy experts through the cache's slots;
- `ping-pong`: SMoE's: the heavy experts through the two stream rows only; at the first decode pass each layer's
  slots take its top-S experts by prompt tokens routed (the initial decode cache).

Modeled (`moepager simulate`'s cost model, warm start, LRFU, each --profiles with this project's nominal CPU side):
the DeepSeek-V2-Lite trace, the one real trace with long prompts (77 requests of 544+ tokens, 33 of 1,056+), each
request's first P tokens its prompt in chunks of --chunk tokens (the engine's --max-batched-tokens), then --decode
decode steps. TTFT: the sum of a request's prefill steps, mean over requests; device share: the prompt's routed
(layer, expert) pairs computed on the device; decode: hit rate and TPOT over the steps after.
Measured on a CPU (the CPU stands in for the --profiles' first device, `--profile`: it places experts as that device
would and computes both sides itself, so the timings are this CPU's, not a GPU's): the DeepSeek-V2-Lite geometry
(--layers MoE layers, random weights) replaying the same trace's last requests: TTFT (median of --rounds), the
share sent to the device, decode hit rate, and every mode's tokens against the all-resident run's.

    python -m benchmarks.smoe_prefill [--prompts 512 1024] [--budgets 3% 6% 12.5%] [--profiles rtx4090-pcie4]
"""

from __future__ import annotations

import argparse
import gc
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import SHARED, converted, ensure_model, machine_state, print_table, write_json
from benchmarks.offload_replay import deepseek_trace, replayed_requests
from moepager.config import EngineConfig, PlacementConfig, SchedulerConfig, StoreConfig
from moepager.planning.cost import CostModel
from moepager.runtime.llm import LLM
from moepager.runtime.replay import ReplaySpec
from moepager.trace.format import DECODE, PREFILL
from moepager.trace.report import step_seconds
from moepager.trace.simulate import SimSpec, simulate
from moepager.trace.workload import Cut, load_workload

MODES = ("cpu", "gpu", "hybrid-cache", "ping-pong")


def arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", nargs="+", type=int, default=[512, 1024], help="prompt lengths in tokens")
    p.add_argument("--budgets", nargs="+", default=["3%", "6%", "12.5%"], help="device expert budgets")
    p.add_argument("--profiles", nargs="+", default=["rtx4090-pcie4", "h100-pcie3"],
                   help="device profiles modeled; the first is the one the measured CPU run stands in for")
    p.add_argument("--decode", type=int, default=32, help="decode steps after each prompt")
    p.add_argument("--chunk", type=int, default=SchedulerConfig().max_batched_tokens,
                   help="prefill chunk (the engine's --max-batched-tokens)")
    p.add_argument("--sim-requests", type=int, default=32, help="requests the model replays per prompt length")
    p.add_argument("--layers", type=int, default=4, help="measured: MoE layers of the DeepSeek-V2-Lite geometry")
    p.add_argument("--requests", type=int, default=1, help="measured: replayed requests per prompt length")
    p.add_argument("--rounds", type=int, default=2, help="measured: runs of each configuration (median TTFT)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-measure", action="store_true", help="the modeled part only")
    p.add_argument("--no-model", action="store_true", help="the measured part only")
    return p


def slots(budget: str, experts: int) -> int:
    """A budget's slots per layer, as the engine rounds a percentage of a layer's experts (at least one)."""
    return max(1, round(float(budget.rstrip("%")) / 100 * experts))


def full_trace() -> Path:
    return converted("deepseek-csv", SHARED / "deepseek-v2-lite", "deepseek-v2-lite")


def sim_spec(mode: str, per_layer: int, device_tokens: int | None) -> SimSpec | None:
    if mode == "gpu":
        return SimSpec("lrfu", per_layer, warm=True)
    if mode == "cpu":
        return SimSpec("lrfu", per_layer, warm=True, execution="hybrid", device_tokens=None, hybrid_prefill="cache")
    prefill = "ping-pong" if mode == "ping-pong" else "cache"
    return SimSpec("lrfu", per_layer, warm=True, execution="hybrid", device_tokens=device_tokens,
                   hybrid_prefill=prefill)  # type: ignore[arg-type]


def modeled(args: argparse.Namespace) -> list[dict]:
    path, rows = full_trace(), []
    for prompt in args.prompts:
        chosen = replayed_requests(path, 0, args.sim_requests, prompt + args.decode, from_end=False)
        work = load_workload(str(path), "recorded", requests=chosen, cut=Cut(prompt, args.decode), chunk=args.chunk)
        h = work.header
        pre, dec = work.step_phase == PREFILL, work.step_phase == DECODE
        first = work.request_N[work.step_tokens[work.step_ptr[:-1]]]  # each step's request
        for profile in args.profiles:
            cost = CostModel.profile(profile, h.expert_bytes, num_shared=h.num_shared)
            device_tokens = cost.expert_times(on_cpu=cost.device_is_cpu).threshold()
            for budget in args.budgets:
                per_layer = slots(budget, h.num_experts)
                for mode in MODES:
                    row: dict[str, Any] = {"prompt": prompt, "profile": profile, "budget": budget, "mode": mode,
                                           "per_layer": per_layer, "device_tokens": device_tokens,
                                           "requests": len(chosen)}
                    if mode == "gpu" and per_layer < h.top_k:
                        rows.append(row | {"skipped": f"{per_layer} slots < top-{h.top_k}"})
                        continue
                    spec = sim_spec(mode, per_layer, device_tokens)
                    assert spec is not None
                    res = simulate(work, spec)
                    t_S = step_seconds(res, work, cost)
                    ttft = np.bincount(first[pre], t_S[pre], minlength=len(chosen))
                    routed = res.requested_SL[pre].sum()
                    on_device = routed - res.cpu_SL[pre].sum()
                    decoded = res.step_tokens[dec].sum()
                    row |= {"ttft_ms": 1e3 * float(ttft.mean()), "device_share": float(on_device / routed),
                            "prefill_hit_rate": res.hit_rate(PREFILL),
                            "prefill_MiB": float(res.demand_loads_SL[pre].sum() * h.expert_bytes) / 2**20
                            / len(chosen),
                            "decode_hit_rate": res.hit_rate(DECODE),
                            "tpot_ms": 1e3 * float(t_S[dec].sum() / max(decoded, 1)),
                            "decode_MiB_per_token": float((res.demand_loads_SL[dec].sum()
                                                           + res.prefetch_loads_SL[dec].sum()) * h.expert_bytes)
                            / 2**20 / max(decoded, 1)}
                    rows.append(row)
    against(rows, "cpu", "ttft_ms", "ttft_vs_cpu")
    against(rows, "hybrid-cache", "ttft_ms", "ttft_vs_cache")
    against(rows, "hybrid-cache", "tpot_ms", "tpot_vs_cache")
    return rows


def against(rows: list[dict], base_mode: str, key: str, out: str) -> None:
    """Each row's `key` as base_mode's over its own (>1: this row is faster), at the same prompt, profile, budget."""
    base = {(r["prompt"], r["profile"], r["budget"]): r.get(key) for r in rows if r["mode"] == base_mode}
    for r in rows:
        b = base.get((r["prompt"], r["profile"], r["budget"]))
        r[out] = b / r[key] if b and r.get(key) else None


def measured(args: argparse.Namespace) -> list[dict]:
    """The CPU standing in for the first profile's device, on replayed routing."""
    model = ensure_model(f"deepseek-v2-lite-L{args.layers + 1}", "deepseek-v2-lite", args.layers + 1)
    trace = deepseek_trace(args.layers)
    profile, rows = args.profiles[0], []
    for prompt in args.prompts:
        chosen = replayed_requests(trace, 0, args.requests, prompt + args.decode)
        spec = ReplaySpec(trace, chosen, prompt, "match", args.decode)
        want, _ = run_once(EngineConfig(model=str(model), threads=args.threads), spec)
        for budget in args.budgets:
            for mode in MODES:
                ttfts, got = [], None
                for _ in range(args.rounds):
                    tokens, got = run_once(engine(model, args, mode, budget, profile), spec)
                    ttfts.append(got.pop("ttft_ms"))
                    got["same_tokens"] = tokens == want
                assert got is not None
                rows.append({"prompt": prompt, "budget": budget, "mode": mode, "profile": profile,
                             "ttft_ms": statistics.median(ttfts), "ttft_runs_ms": ttfts} | got)
    if not all(r["same_tokens"] for r in rows):
        raise SystemExit("a mode's tokens differ from the all-resident run's")
    against(rows, "cpu", "ttft_ms", "ttft_vs_cpu")
    against(rows, "hybrid-cache", "ttft_ms", "ttft_vs_cache")
    return rows


def engine(model: Path, args: argparse.Namespace, mode: str, budget: str, profile: str) -> EngineConfig:
    if mode == "cpu":
        return EngineConfig(model=str(model), threads=args.threads, placement=PlacementConfig(execution="cpu-experts"))
    placement = PlacementConfig(execution="gpu") if mode == "gpu" else PlacementConfig(
        execution="hybrid", profile=profile, hybrid_prefill="ping-pong" if mode == "ping-pong" else "cache")
    return EngineConfig(model=str(model), threads=args.threads, store=StoreConfig(expert_memory=budget),
                        placement=placement)


def run_once(config: EngineConfig, spec: ReplaySpec) -> tuple[list[list[int]], dict[str, Any]]:
    """Build an engine, replay the requests, read its figures, and free it before the next one loads (each holds
    the model): the tokens and the figures."""
    with LLM(config=config, show_progress=False) as llm:
        tokens = [c.token_ids for c in llm.replay(spec)]
        got = figures(llm) | {"ttft_ms": 1e3 * llm.last_stats.ttft_s}
        store = getattr(llm.loaded.experts, "store", None)
        if store is not None:
            store.close()
    del llm
    gc.collect()
    return tokens, got


def figures(llm: LLM) -> dict[str, Any]:
    """The last run's prefill device share and decode hit rate, from the store's counters (cpu-experts: none)."""
    store = getattr(llm.loaded.experts, "store", None)
    if store is None:
        return {"device_share": 0.0, "decode_hit_rate": None, "per_layer": 0}
    phases = store.counters.phases
    pre, dec = phases["prefill"], phases["decode"]
    routed = sum(pre.hits.values()) + sum(pre.misses.values())
    hits, requested = sum(dec.hits.values()), sum(dec.hits.values()) + sum(dec.misses.values())
    return {"device_share": 1 - pre.on_cpu / max(routed, 1), "decode_hit_rate": hits / max(requested, 1),
            "per_layer": min(store.device.table.quota.values())}


def main() -> None:
    args = arguments().parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    state = machine_state()
    model_rows = [] if args.no_model else modeled(args)
    if model_rows:
        print(f"modeled (DeepSeek-V2-Lite trace, prefill in chunks of {args.chunk}, then {args.decode} decode steps; "
              "simulate's cost model, LRFU, warm start):")
        print_table(["prompt", "profile", "budget", "slots", "mode", "TTFT ms", "x cpu", "x cache", "on device %",
                     "prefill MiB", "decode hit %", "TPOT ms", "x cache"],
                    [[r["prompt"], r["profile"], r["budget"], r["per_layer"], r["mode"],
                      *([r["ttft_ms"], r["ttft_vs_cpu"], r["ttft_vs_cache"], 100 * r["device_share"], r["prefill_MiB"],
                         100 * r["decode_hit_rate"], r["tpot_ms"], r["tpot_vs_cache"]]
                        if "skipped" not in r else [r["skipped"]] + ["-"] * 7)] for r in model_rows])
    rows = [] if args.no_measure else measured(args)
    if rows:
        print(f"\nmeasured on this CPU standing in for {args.profiles[0]} (DeepSeek-V2-Lite geometry, {args.layers} "
              "MoE layers, replayed routing; timings are this CPU's):")
        print_table(["prompt", "budget", "slots", "mode", "TTFT ms", "x cpu", "x cache", "on device %",
                     "decode hit %", "tokens = resident"],
                    [[r["prompt"], r["budget"], r["per_layer"], r["mode"], r["ttft_ms"], r["ttft_vs_cpu"] or "-",
                      r["ttft_vs_cache"] or "-", 100 * r["device_share"],
                      "-" if r["decode_hit_rate"] is None else 100 * r["decode_hit_rate"], r["same_tokens"]]
                     for r in rows])
    out = write_json("smoe_prefill", {"machine": state, "args": vars(args), "modeled": model_rows, "measured": rows})
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
