"""One entry point for every benchmark: `python -m benchmarks list | run NAME [ARGS...] | run --suite SUITE`.

Each benchmark runs as `python -m benchmarks.NAME` in a process of its own (one loaded engine at a time: a
benchmark's memory is freed before the next starts), with the trace root in MOEPAGER_TRACES. A benchmark whose
needs this machine lacks (a GPU, the real traces, llama.cpp, the `bench` extra) is skipped with the reason; one that
finds its data missing exits with status 3, which counts as skipped too. Suites: `quick` (CPU, minutes: what CI runs
as a smoke test, never a timing assertion), `cpu`, `gpu` and `traces` (every benchmark that needs them, full size).
Results: benchmarks/results/NAME.json in one schema (benchmarks/common.py `write_json`); the latest figure of each
lives in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import SHARED, TRACES_ENV

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = 3
"""Exit status of a benchmark that found its data missing (common.need_traces)."""


@dataclass(frozen=True)
class Bench:
    question: str
    needs: frozenset[str] = frozenset()
    """gpu, traces, llama.cpp, bench (transformers and matplotlib: `pip install -e ".[bench]"`)."""
    suites: frozenset[str] = frozenset({"cpu"})
    quick: tuple[str, ...] | None = None
    """Arguments of its smoke run in the quick suite (None: not in it)."""
    runtime: str = ""
    """Roughly how long a full run takes on this project's 2-core machine (or the GPU machine)."""
    traces: tuple[str, ...] = field(default=())
    """Trace directories under the trace root it reads."""


def _b(question: str, needs: str = "", suites: str = "cpu", quick: tuple[str, ...] | None = None, runtime: str = "",
       traces: tuple[str, ...] = ()) -> Bench:
    return Bench(question, frozenset(needs.split()), frozenset(suites.split()), quick, runtime, traces)


DS, MIX, OLMOE, LLAMA4 = "deepseek-v2-lite", "mixtral-8x7b", "olmoe-stats", "llama4-maverick"
BENCHMARKS: dict[str, Bench] = {
    "attention": _b("Which decode attention layout is fastest and bit-equal on this CPU?", quick=("--reps", "3"),
                    runtime="1 min"),
    "gemv": _b("How fast do torch's one-token kernels read a weight matrix?", runtime="5 min"),
    "expert_kernels": _b("Which expert kernel computes a MoE layer fastest at 1 and 64 tokens?", runtime="5 min"),
    "cpu_kernels": _b("Do moepager's fused CPU kernels read a layer's experts at the memory-bandwidth limit?",
                      quick=("--geometries", "demo", "--tokens", "1", "4", "--threads", "1", "--reps", "3"),
                      runtime="5 min"),
    "threads": _b("Which thread count decodes fastest on an idle and on a busy machine?", runtime="2 min"),
    "overhead": _b("How many Python calls and how much time does a decode token cost?",
                   quick=("--rounds", "1", "--decode", "8"), runtime="3 min"),
    "decode_cpu": _b("HF transformers against moepager on the CPU, prefill and decode", needs="bench",
                     runtime="15 min"),
    "peers": _b("moepager against llama.cpp and HF on the CPU, bf16/int8/int4", needs="bench",
                quick=("--models", "demo", "--threads", "1", "--rounds", "1", "--decode", "8", "--formats", "bf16",
                       "int8"), runtime="20-60 min (llama.cpp rows need the peers extra)"),
    "batched_decode": _b("What does batched decode gain, eager and compiled?", runtime="15 min"),
    "serve_load": _b("Does continuous batching pay over HTTP and on replayed routing?", needs="bench traces",
                     runtime="15 min", traces=(DS,)),
    "quant_quality": _b("How much do int8/int4 experts change the model (perplexity, agreement)?",
                        needs="traces", runtime="10 min", traces=(OLMOE,)),
    "quant_paged": _b("Paged int8/int4 experts against bf16 at the same byte budget", needs="traces",
                      suites="cpu traces", runtime="30 min", traces=(DS,)),
    "hit_rate": _b("Which eviction policy hits most on real routing (MoEpic Table 1)?", needs="traces bench",
                   suites="cpu traces", quick=("--quick",), runtime="10 min", traces=(DS, MIX)),
    "demo_routing": _b("Does the built-in model route like a real MoE?", needs="traces", suites="cpu traces",
                       runtime="3 min", traces=(DS, OLMOE)),
    "predictors": _b("How well does each predictor forecast routing d layers ahead?", needs="traces",
                     suites="cpu traces", runtime="20 min", traces=(DS, MIX, OLMOE)),
    "forecast_cache": _b("Do predictors beat co-occurrence, and forecast caching beat LRU?", needs="traces bench",
                         suites="cpu traces", runtime="30 min", traces=(DS, MIX, OLMOE)),
    "prefetch_cpu": _b("Does prefetch lower TPOT when experts stream from disk?", needs="traces",
                       suites="cpu traces", runtime="20 min", traces=(OLMOE,)),
    "offload_replay": _b("Offloading on replayed real routing: budgets x policies x predictors", needs="traces",
                         suites="cpu traces", runtime="60 min", traces=(DS,)),
    "bigger_than_ram": _b("A model bigger than RAM on the CPU: moepager paging experts from disk against llama.cpp's "
                          "mmap on one GGUF file, prefill and decode",
                          quick=("--preset", "tiny", "--arch", "deepseek_v2", "--memory-limit", "none", "--rounds",
                                 "1", "--prompts", "32", "--decode", "4", "--budgets", "auto", "25%", "--disk-probe",
                                 "0.01"),
                          runtime="30-60 min (and 5 min to make the 31 GB "
                          "model once; llama.cpp rows need the peers extra)"),
    "offload_cpu": _b("offload_replay's CPU preset: experts paged from disk", needs="traces", suites="cpu traces",
                      runtime="60 min", traces=(DS,)),
    "offload_gpu": _b("offload_replay's GPU preset: experts paged host->device", needs="gpu traces",
                      suites="gpu traces", runtime="20 min", traces=(DS,)),
    "hybrid": _b("Does computing missing experts on the CPU (--execution hybrid, cpu-experts) beat copying them?",
                 needs="traces", suites="cpu gpu traces",
                 quick=("--modes", "gpu", "hybrid", "cpu-experts", "--decode", "8", "--profiles", "h100-pcie3",
                        "--sim-requests", "8"),
                 runtime="3 min (CPU); 15 min (GPU)", traces=(DS, MIX, OLMOE)),
    "smoe_prefill": _b("Does SMoE's ping-pong prefill (the heavy experts through two stream rows, then the initial "
                       "decode cache) beat copying them through the cache, copying every expert, and the CPU?",
                       needs="traces", suites="cpu traces",
                       quick=("--sim-requests", "4", "--prompts", "512", "--budgets", "12.5%", "--decode", "8",
                              "--no-measure"),
                       runtime="25 min (2 min modeled only: --no-measure)", traces=(DS,)),
    "token_scheduler": _b("Does ExpertFlow's token scheduler (--batch-policy expertflow) move fewer expert bytes?",
                          needs="traces", suites="cpu traces",
                          quick=("--workloads", "built-in", "--clients", "8", "--decode", "4"),
                          runtime="3 min", traces=(DS, OLMOE)),
    "grouping": _b("What can grouping decode requests by routing path save, and how much of it do the scheduler's "
                   "paths reach (ExpertFlow), on dense and sparse routing?", needs="traces", suites="cpu traces",
                   quick=("--sizes", "8", "--draws", "2", "--fit", "40", "--test", "40", "--path-epochs", "1"),
                   runtime="5 min",
                   traces=(DS, LLAMA4)),
    "workers": _b("Do OD-MoE's worker processes keep up with one process, and would an int8 shadow predict routing?",
                  needs="traces", quick=("--workers", "2", "--prompts", "2", "--tokens", "8", "--shadow-docs", "4",
                         "--kv-tokens", "8"),
                  runtime="2 min", traces=(OLMOE,)),
    "split": _b("Do MoEpic's split experts and per-layer configurator lower TPOT and bytes against the even split?",
                needs="traces", suites="cpu traces",
                quick=("--workloads", "built-in", "--budgets", "25%", "--rounds", "1", "--requests", "2", "--decode",
                       "6"),
                runtime="25 min", traces=(DS, MIX, OLMOE)),
    "decode_gpu": _b("GPU decode, all resident, against HF and the bandwidth limit", needs="gpu", suites="gpu",
                     runtime="10 min"),
}
SUITES = ("quick", "cpu", "gpu", "traces")


def missing(bench: Bench) -> list[str]:
    """What this machine lacks for `bench`, as reasons."""
    reasons = []
    if "gpu" in bench.needs:
        import torch

        if not torch.cuda.is_available():
            reasons.append("needs a CUDA GPU")
    if "traces" in bench.needs:
        absent = [t for t in bench.traces if not (SHARED / t).exists()]
        if absent:
            reasons.append(f"needs traces {', '.join(absent)} under {SHARED} (--traces DIR or {TRACES_ENV})")
    if "llama.cpp" in bench.needs and importlib.util.find_spec("llama_cpp") is None:
        reasons.append('needs llama.cpp: pip install -e ".[peers]"')
    if "bench" in bench.needs and any(importlib.util.find_spec(m) is None for m in ("transformers", "matplotlib")):
        reasons.append('needs the bench extra: pip install -e ".[bench]"')
    return reasons


def run_one(name: str, args: list[str], env: dict[str, str]) -> str:
    """Run one benchmark in a process of its own; returns passed, failed or skipped (with the reason printed)."""
    reasons = missing(BENCHMARKS[name])
    if reasons:
        print(f"[{name}] skipped: {'; '.join(reasons)}", flush=True)
        return "skipped"
    print(f"[{name}] python -m benchmarks.{name} {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=ROOT, env=env).returncode
    took = time.perf_counter() - t0
    outcome = "skipped" if rc == SKIPPED else "passed" if rc == 0 else "failed"
    print(f"[{name}] {outcome} in {took:.0f} s" + (f" (exit {rc})" if outcome == "failed" else ""), flush=True)
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, help=f"trace root (default {SHARED}; or set {TRACES_ENV})")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every benchmark: question, needs, suites, run time")
    run = sub.add_parser("run", help="run one benchmark (further arguments go to it) or a suite", add_help=False)
    run.add_argument("name", nargs="?", choices=sorted(BENCHMARKS), metavar="NAME")
    run.add_argument("--suite", choices=SUITES)
    run.add_argument("-h", "--help", action="store_true", help="this help; after NAME, that benchmark's own")
    args, rest = parser.parse_known_args(argv)
    if args.command == "run" and args.help:
        if args.name is None:
            run.print_help()
            return 0
        rest = ["--help", *rest]
    env = dict(os.environ)
    if args.traces is not None:
        env[TRACES_ENV] = str(args.traces.resolve())
    if args.command == "list":
        width = max(map(len, BENCHMARKS))
        for name, b in BENCHMARKS.items():
            needs = ", ".join(sorted(b.needs)) or "-"
            print(f"{name:<{width}}  {b.question}\n{'':<{width}}  needs: {needs}; suites: "
                  f"{', '.join(sorted(b.suites | ({'quick'} if b.quick is not None else set())))}; {b.runtime}")
        return 0
    if (args.name is None) == (args.suite is None):
        parser.error("run takes a benchmark NAME or --suite SUITE")
    if args.name is not None:
        outcome = run_one(args.name, rest, env)
        return 1 if outcome == "failed" else 0
    if rest:
        parser.error(f"a suite takes no benchmark arguments: {' '.join(rest)}")
    if args.suite == "quick":
        chosen = [(n, list(b.quick)) for n, b in BENCHMARKS.items() if b.quick is not None]
    else:
        chosen = [(n, []) for n, b in BENCHMARKS.items() if args.suite in b.suites]
    outcomes = {name: run_one(name, extra, env) for name, extra in chosen}
    counts = {k: sum(v == k for v in outcomes.values()) for k in ("passed", "failed", "skipped")}
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
