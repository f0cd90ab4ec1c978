"""`moepager generate [--model PATH] PROMPT ...`: generate, stream text, print the run's statistics."""

from __future__ import annotations

import argparse
import sys

from moepager.config import PrefetchConfig, StoreConfig
from moepager.errors import MoepagerError
from moepager.policies import ENGINE_POLICIES
from moepager.predictors import PREDICTORS
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams

HELP = "generate text for one or more prompts (one static batch) and print the run's statistics"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--model", help="Hugging Face checkpoint directory (default: the built-in demo model)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="convert weights (default: as stored)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    add_store_arguments(p)
    add_prefetch_arguments(p)
    p.add_argument("--stats-json", metavar="PATH", help="also write the statistics as JSON")
    p.add_argument("--record-trace", metavar="PATH",
                   help="write every token's routing (ids, weights, full gate scores) as a trace file")
    p.add_argument("--record-hidden", action="store_true",
                   help="with --record-trace: also record every router input (float16; token-wise predictor training)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("expert memory (default: every expert resident)")
    g.add_argument("--expert-memory", metavar="SIZE",
                   help="device expert cache, e.g. 6GiB, 800MB, 25%% of all experts; the rest is paged in")
    g.add_argument("--host-memory", metavar="SIZE",
                   help="with --device cuda: pinned host RAM for experts (default all); the rest is read from disk")
    g.add_argument("--policy", choices=ENGINE_POLICIES, default="lru",
                   help="eviction policy (default lru; fmoe weighs LFU counts by the --predictor's probabilities)")
    g.add_argument("--cache-scope", choices=["layer", "global"], default="layer",
                   help="layer: equal share of the cache per MoE layer (default); global: shared by all layers")
    g.add_argument("--io-threads", type=int, default=4, help="threads reading experts from disk (default 4)")
    g.add_argument("--direct-io", choices=["auto", "on", "off"], default="auto",
                   help="O_DIRECT disk reads (auto: where the file system allows; off: page cache, then dropped)")
    g.add_argument("--cold", action="store_true", help="start with an empty expert cache")


def add_prefetch_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing prediction and prefetch (needs --expert-memory)")
    g.add_argument("--predictor", choices=PREDICTORS,
                   help="forecast routing and load experts ahead (outputs do not change)")
    g.add_argument("--predictor-file", metavar="PATH", help="fitted predictor (`moepager predictor fit`)")
    g.add_argument("--prefetch-distance", type=int, metavar="D",
                   help="MoE layers between forecast and target (default: transition/gate-lookahead 1, "
                        "expert-map 3, token-wise one token)")
    g.add_argument("--prefetch-k", type=int, metavar="K", help="experts prefetched per forecast row (default top-k)")
    g.add_argument("--prefetch-inflight", type=int, metavar="N", help="prefetches loading at once (default 2 x top-k)")
    g.add_argument("--learn-maps", action="store_true", help="expert-map: add each iteration's map to the store")


def prefetch_config(args: argparse.Namespace) -> PrefetchConfig:
    return PrefetchConfig(predictor=args.predictor, file=args.predictor_file, distance=args.prefetch_distance,
                          per_row=args.prefetch_k, max_inflight=args.prefetch_inflight, learn=args.learn_maps)


def store_config(args: argparse.Namespace) -> StoreConfig:
    return StoreConfig(expert_memory=args.expert_memory, host_memory=args.host_memory, policy=args.policy,
                       scope=args.cache_scope, io_threads=args.io_threads, direct_io=args.direct_io,
                       warm=not args.cold)


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, threads=args.threads, store=store_config(args),
              prefetch=prefetch_config(args), show_progress=not args.quiet)
    if llm.tokenizer is None:
        raise MoepagerError("this checkpoint has no tokenizer.json, so text prompts cannot be encoded")
    single = len(args.prompts) == 1
    if single:
        sys.stdout.write(args.prompts[0])

    def stream(_row: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    completions = llm.generate(args.prompts, params, chat=args.chat, on_text=stream if single else None,
                               record_trace=args.record_trace, record_hidden=args.record_hidden)
    if single:
        sys.stdout.write("\n")
    else:
        for i, (prompt, c) in enumerate(zip(args.prompts, completions)):
            print(f"[{i}] {prompt}{c.text}")
    print(f"\n{llm.last_stats.table()}")
    if args.stats_json:
        llm.last_stats.write_json(args.stats_json)
    if args.record_trace:
        print(f"routing trace: {args.record_trace} (replay it: moepager simulate {args.record_trace})")
    return 0
