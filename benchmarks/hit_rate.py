"""MoEpic Table 1, on real traces: hit rate of every cache policy at several per-layer cache sizes.

DeepSeek-V2-Lite (../shared/traces/deepseek-v2-lite): the 1,999 training prompts replayed one after another in
decode order (each token a step) at 8/16/24/32/48 cached experts per layer (of 64, top-6). The 100 held-out
test prompts are the frequency prior of static-hot and the (static) expert map fMoE's eviction reads.
Mixtral-8x7B (../shared/traces/mixtral-8x7b, the *_2_routing.jsonl decode traces) at 2/4/6 of 8 experts; its
prior is OLMoE-stats' independent Mixtral counts (layers 0/7/15 only; other layers have none).
Also times one whole-trace replay (all 2,099 prompts, 193k tokens; target < 30 s per policy and size).
Expected shape (MoEpic): LCP >= max(LFU, LRU) > RND, all <= Belady. Where the traces disagree, this says so.
Usage: python benchmarks/hit_rate.py [--quick]   (writes results/hit_rate.json and hit_rate_*.png)
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import RESULTS, SHARED, converted, machine_state, write_json
from moepager.trace.convert import ConvertOptions
from moepager.trace.format import TraceReader
from moepager.trace.report import format_table, plot_hit_rates, summary
from moepager.trace.simulate import SimSpec, simulate
from moepager.trace.workload import load_workload

POLICIES = ["rnd", "lru", "lfu", "lcp", "fmoe", "static-hot", "belady"]


def run_table(title: str, work, prior, sizes, tag: str) -> list[dict]:
    rows = []
    for policy in POLICIES:
        for size in sizes:
            forecast = "prior" if policy == "fmoe" else "none"
            result = simulate(work, SimSpec(policy, size, forecast=forecast), prior)
            rows.append(summary(result, work, None))
            print(f"  {policy:<10} {size:>3}: {100 * result.hit_rate():5.1f}%  ({result.wall_s:.1f} s)", flush=True)
    print(f"\n{title}\n{format_table(rows)}\n")
    plot_hit_rates(rows, RESULTS / f"hit_rate_{tag}.png", title)
    return rows


def shape_check(rows: list[dict], sizes) -> list[str]:
    notes = []
    for size in sizes:
        hr = {r["policy"]: r["hit_rate"] for r in rows if r["capacity"] == size}
        if hr["lcp"] + 1e-9 < max(hr["lfu"], hr["lru"]):
            notes.append(f"size {size}: LCP {hr['lcp']:.4f} below max(LFU {hr['lfu']:.4f}, LRU {hr['lru']:.4f})")
        if min(hr["lfu"], hr["lru"]) <= hr["rnd"]:
            notes.append(f"size {size}: RND {hr['rnd']:.4f} not below LFU/LRU ({hr['lfu']:.4f}/{hr['lru']:.4f})")
        beaten = [p for p, v in hr.items() if v > hr["belady"] + 1e-9]
        if beaten:
            notes.append(f"size {size}: above Belady: {beaten} (static-hot starts preloaded)")
    return notes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="200 DeepSeek prompts, sizes 8 and 32 (a smoke run)")
    args = ap.parse_args()
    state = machine_state()
    ds = converted("deepseek-csv", SHARED / "deepseek-v2-lite", "deepseek-v2-lite")
    everything = load_workload(str(ds))
    names = everything.names
    held_out = [i for i, n in enumerate(names) if n.startswith("test_datasets")]
    train = [i for i, n in enumerate(names) if not n.startswith("test_datasets")]
    t0 = time.perf_counter()
    whole = simulate(everything, SimSpec("lru", 16))
    speed = {"tokens": len(everything.phase_N), "lru_16_wall_s": whole.wall_s,
             "load_s": time.perf_counter() - t0 - whole.wall_s}
    lcp_whole = simulate(everything, SimSpec("lcp", 16))
    speed["lcp_16_wall_s"] = lcp_whole.wall_s
    print(f"whole DeepSeek trace ({speed['tokens']} tokens x 26 layers x top-6): LRU@16 {whole.wall_s:.1f} s, "
          f"LCP@16 {lcp_whole.wall_s:.1f} s")
    if args.quick:
        train, sizes = train[:200], [8, 32]
    else:
        sizes = [8, 16, 24, 32, 48]
    prior = load_workload(str(ds), requests=held_out).counts_LE()
    work = load_workload(str(ds), requests=train)
    ds_rows = run_table(f"DeepSeek-V2-Lite, {len(train)} prompts, {len(work.phase_N)} tokens, decode order, "
                        "cached experts per layer of 64", work, prior, sizes, "deepseek")
    mx = converted("mixtral-jsonl", SHARED / "mixtral-8x7b" / "routing_data_collected", "mixtral-8x7b")
    mx_all = load_workload(str(mx))
    chosen = [i for i, n in enumerate(mx_all.names) if n.split("/")[0] in ("humaneval_2_routing", "gsm8k_2_routing")]
    mx_work = load_workload(str(mx), requests=chosen)
    olmoe = converted("olmoe-counts", SHARED / "olmoe-stats" / "mistral" / "expert_counts", "mixtral-olmoe-stats",
                      ConvertOptions(num_experts=8))
    with TraceReader(olmoe) as reader:
        counts = sum(reader.prior(n) for n in reader.prior_names)
    mx_prior = np.zeros((32, 8))
    mx_prior[[0, 7, 15]] = counts
    mx_rows = run_table(f"Mixtral-8x7B, {len(chosen)} requests, {len(mx_work.phase_N)} decode tokens, cached experts "
                        "per layer of 8", mx_work, mx_prior, [2, 4, 6], "mixtral")
    notes = shape_check(ds_rows, sizes) + shape_check(mx_rows, [2, 4, 6])
    print("shape check (MoEpic: LCP >= max(LFU, LRU) > RND, all <= Belady):")
    print("\n".join(f"  - {n}" for n in notes) if notes else "  all sizes agree")
    path = write_json("hit_rate", {"machine": state, "speed": speed, "deepseek": ds_rows, "mixtral": mx_rows,
                                   "shape_notes": notes, "quick": args.quick})
    print(f"wrote {path} and {RESULTS}/hit_rate_{{deepseek,mixtral}}.png")


if __name__ == "__main__":
    main()
