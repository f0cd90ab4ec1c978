"""Overhead of a decode step on the built-in model: moepager-level Python calls per decode token (the architecture
review's method, a 17-token generation less a 1-token one, over 16 steps: exact resident, a few percent of spread when
paged, with load timing) and decode tok/s (the median step over interleaved rounds, all configurations in one run),
all resident, at a 25% budget (experts read buffered, `--direct-io off`; each read's pages are dropped after it, so
misses still reach the disk), and at 25% with gate-lookahead prefetch; each eager and with the compiled decode step
(`--compile`: a paged step leaves its graph at each MoE layer). Issue 15's goals: <= 40 calls resident, <= 80 at a
25% budget with a predictor. tests/runtime/test_overhead.py guards the counts.

    python benchmarks/overhead.py [--threads 1] [--rounds 5] [--decode 32]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import machine_state, print_table, write_json
from moepager.config import EngineConfig, PrefetchConfig, StoreConfig
from moepager.runtime.llm import LLM
from moepager.runtime.profiling import calls_per_decode_token
from moepager.runtime.sampling import SamplingParams

PAGED = StoreConfig(expert_memory="25%", direct_io="off")
CONFIGS = {
    "all resident": EngineConfig(),
    "all resident, --compile": EngineConfig(compile=True),
    "25% budget": EngineConfig(store=PAGED),
    "25% budget, --compile": EngineConfig(store=PAGED, compile=True),
    "25% budget + gate-lookahead": EngineConfig(store=PAGED, prefetch=PrefetchConfig("gate-lookahead")),
    "25% budget + gate-lookahead, --compile": EngineConfig(store=PAGED, prefetch=PrefetchConfig("gate-lookahead"),
                                                           compile=True),
}
PROMPT = "The history of"
COMPILED = ", --compile"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per configuration")
    p.add_argument("--decode", type=int, default=32, help="decode steps timed per round")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    state = machine_state()
    engines = {label: LLM(config=config, show_progress=False) for label, config in CONFIGS.items()}
    calls = {label: calls_per_decode_token(llm) for label, llm in engines.items()}
    params = SamplingParams(max_tokens=args.decode + 1, ignore_eos=True)
    steps: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(args.rounds):
        for label, llm in engines.items():
            llm.generate(PROMPT, params)
            steps[label] += llm.last_stats.tpot_s
    rows = [{"config": label, "calls_per_decode_token": calls[label],
             "decode_tok_per_s": 1 / statistics.median(steps[label])} for label in engines]
    rate = {r["config"]: r["decode_tok_per_s"] for r in rows}
    print_table(["configuration", "moepager Python calls / decode token", "decode tok/s", "compiled vs eager"],
                [[r["config"], r["calls_per_decode_token"], r["decode_tok_per_s"],
                  f"{r['decode_tok_per_s'] / rate[r['config'].removesuffix(COMPILED)]:.2f}x"
                  if r["config"].endswith(COMPILED) else ""] for r in rows])
    print(f"wrote {write_json('overhead', {'machine': state, 'threads': args.threads, 'rows': rows})}")


if __name__ == "__main__":
    main()
