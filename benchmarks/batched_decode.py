"""Batched decode on the built-in model: B concurrent requests decoding together (the server's continuous batching),
eager against `--compile` (whose batched graph takes any row count of two or more: accel/compiled.py), side by side
in interleaved rounds. Per row count: the median decode step's time, and output tokens per second over all rows
(B / step); the compiled engines compile their batched graphs up front (`LLM.warm_batched_decode`, as `moepager
serve --compile` does). Prompts: the demo model's validation documents, cut to 16 tokens.

    python benchmarks/batched_decode.py [--threads 1 2] [--rows 1 2 4 8 16] [--rounds 3] [--decode 32]
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import demo_documents, machine_state, print_table, write_json
from moepager.config import EngineConfig
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams

PROMPT_TOKENS = 16


def prompts(llm: LLM, count: int) -> list[list[int]]:
    """`count` prompts of PROMPT_TOKENS token ids each, from the validation documents."""
    docs = [d for d in demo_documents()[1] if len(llm.encode(d)) >= PROMPT_TOKENS]
    return [llm.encode(docs[i % len(docs)])[:PROMPT_TOKENS] for i in range(count)]


def step_time(llm: LLM, ids: list[list[int]], decode: int) -> float:
    """The median decode step of one batched generation of `ids` (every row decodes `decode` tokens)."""
    llm.generate(ids, SamplingParams(max_tokens=decode + 1, ignore_eos=True))
    return statistics.median(llm.last_stats.tpot_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best round's median step counts")
    p.add_argument("--decode", type=int, default=32, help="decode steps per generation")
    args = p.parse_args()
    state = machine_state()
    rows: list[dict[str, float]] = []
    ids: list[list[int]] = []
    for threads in args.threads:  # engines per thread count: a compiled graph is guarded on it
        engines = {label: LLM(config=EngineConfig(threads=threads, compile=label == "compiled"), show_progress=False)
                   for label in ("eager", "compiled")}
        engines["compiled"].warm_batched_decode()
        ids = ids or prompts(engines["eager"], max(args.rows))  # tokenized once: the same for every thread count
        for b in args.rows:
            for llm in engines.values():  # a warm-up generation at this row count
                step_time(llm, ids[:b], 4)
            best = {label: float("inf") for label in engines}
            for _ in range(args.rounds):
                for label, llm in engines.items():
                    best[label] = min(best[label], step_time(llm, ids[:b], args.decode))
            rows.append({"threads": threads, "rows": b, "eager_step_ms": 1e3 * best["eager"],
                         "compiled_step_ms": 1e3 * best["compiled"], "eager_tok_per_s": b / best["eager"],
                         "compiled_tok_per_s": b / best["compiled"], "ratio": best["eager"] / best["compiled"]})
    print_table(["threads", "rows", "eager step ms", "compiled step ms", "eager tok/s", "compiled tok/s",
                 "compiled / eager"],
                [[r["threads"], r["rows"], f"{r['eager_step_ms']:.2f}", f"{r['compiled_step_ms']:.2f}",
                  f"{r['eager_tok_per_s']:.1f}", f"{r['compiled_tok_per_s']:.1f}", f"{r['ratio']:.2f}x"]
                 for r in rows])
    print(f"wrote {write_json('batched_decode', {'machine': state, 'decode': args.decode, 'rows': rows})}")


if __name__ == "__main__":
    main()
