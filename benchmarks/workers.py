"""OD-MoE's worker processes (`--workers N --worker-memory S`): throughput and bytes against one process paging at the
same total expert memory, and how well an int8 shadow of the model would predict its routing.

Part 1, measured (processes as nodes on this machine, one torch thread each, gloo): the built-in model decodes
`--prompts` prompts of the demo validation text (`--tokens` each, greedy) in one process with `--expert-memory B`, then
as a main rank with 2 and 4 workers, each worker's cache `--worker-memory B` of its own experts (so the same total),
read from the checkpoint on demand (a prompt's layer calls spread over every worker, OD-MoE's prefill; with more than 2
workers also on each layer's group only, `--worker-prefill group`); then 2 workers loading ahead what the main rank's
`--predictor` forecasts (OD-MoE without a shadow rank), and 2 workers with a shadow rank (`--shadow`: the int8 copy
computing each pass as it is announced and sending each layer's routing to the workers), the same with KV alignment
every pass, and running `--align-period` - 1 passes ahead on its own greedy tokens. Per run: TTFT, decode tok/s, TPOT,
expert bytes read per output token, the workers' hit rate, the share of routed experts a forecast had named, and whether
the tokens equal the single process's.
Part 3, modeled (planning/od_moe.py, OD-MoE §2.3-2.4): 2, 4, 8 and 16 workers on the Mixtral-8x7B decode traces with
the paper's nodes and links, without a shadow and with the paper's and our measured int8 recall, against every expert
in one GPU's memory.
Part 3b, modeled prefill (OD-MoE §2.7): the DeepSeek-V2-Lite trace's prompts with their layer calls spread over every
worker against each layer's group.
Part 2, OD-MoE's shadow model: the built-in model with int8 experts and int8 dense projections (the shadow) run over
the same tokens as the full model (teacher-forced: the validation documents), and per MoE layer the recall of the
full model's top-k in the shadow's top-k (OD-MoE reports 97.34% for INT8).
Part 2b, the same shadow decoding with its KV cache aligned every K passes (`shadow_recall_kv`).

    python -m benchmarks.workers [--budget 25%] [--workers 2 4] [--prompts 4] [--tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from benchmarks.common import demo_documents, machine_state, print_table, write_json
from moepager.config import EngineConfig, ExpertFormat, StoreConfig
from moepager.experts.remote.kv_align import slots, write
from moepager.types import RoutingDecision

if TYPE_CHECKING:
    from moepager.experts.remote.placement import Links


def arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", default="25%")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--shadow-docs", type=int, default=24, help="part 2: validation documents (128 tokens each)")
    p.add_argument("--predictor", default="gate-lookahead",
                   help="the predictor of the extra 2-worker run whose forecasts the workers load ahead ('' : none)")
    p.add_argument("--rank-out", help=argparse.SUPPRESS)
    p.add_argument("--rank-predictor", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank-shadow", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-shadow", action="store_true", help="leave out the 2-worker runs with a shadow rank")
    p.add_argument("--align-period", type=int, default=3,
                   help="the second shadow run's --align-period: it runs that many passes ahead, less one (1: no such "
                        "run)")
    p.add_argument("--rank-align", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--rank-kv-align", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rank-prefill", default=None, help=argparse.SUPPRESS)
    p.add_argument("--kv-tokens", type=int, default=48,
                   help="part 2b: teacher-forced decode passes per document after its prompt")
    return p


def prompts(count: int) -> list[str]:
    _, validation = demo_documents()
    return [" ".join(doc.split()[:16]) for doc in validation[:count]]


def generate(config: EngineConfig, args: argparse.Namespace, links: Links | None = None) -> dict:
    from moepager.runtime.llm import LLM
    from moepager.runtime.sampling import SamplingParams

    llm = LLM(config=config, show_progress=False, **({"links": links} if links is not None else {}))  # --workers
    out = llm.generate(prompts(args.prompts), SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0))
    s = llm.last_stats
    decoded = s.generated_tokens - s.num_prompts
    experts = s.sections["experts"].to_dict()
    moved = sum(experts.get(p, {}).get("bytes_disk", 0) for p in ("prefill", "decode"))
    return {"tokens": [c.token_ids for c in out], "decode_tok_s": decoded / s.decode_s, "ttft_ms": 1e3 * s.ttft_s,
            "tpot_ms": 1e3 * s.tpot_median_s, "generated": s.generated_tokens, "bytes_disk": moved,
            "hit_rate": experts.get("decode", {}).get("hit_rate")}


def rank_main(args: argparse.Namespace) -> int:
    """One process of a torchrun run: the main rank generates and writes its figures and the workers' counters."""
    from moepager.config import PrefetchConfig, RemoteConfig
    from moepager.distributed.roles import launch, stop_workers

    config = EngineConfig(threads=1, prefetch=PrefetchConfig(args.rank_predictor or None),
                          remote=RemoteConfig(workers=1, worker_memory=args.budget, shadow=args.rank_shadow,
                                              align_period=args.rank_align, kv_align_period=args.rank_kv_align,
                                              worker_prefill=args.rank_prefill))

    def main(cfg: EngineConfig, links: Links) -> int:
        row = generate(cfg, args, links)
        row["workers"] = stop_workers(cfg.remote.workers + 1 + cfg.remote.shadow, cfg.remote.worker_timeout_s, links)
        Path(args.rank_out).write_text(json.dumps(row))
        return 0

    return launch(config, main)


def measured(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(1)
    rows = [{"run": "1 process"} | generate(EngineConfig(threads=1, store=StoreConfig(expert_memory=args.budget)),
                                            args)]
    runs = [(w, None) for w in args.workers] + [(w, "group") for w in args.workers if w > 2] + \
        ([(2, args.predictor)] if args.predictor else []) + \
        ([(2, "shadow"), (2, "shadow 1 1")] if not args.no_shadow else []) + \
        ([(2, f"shadow {args.align_period}")] if not args.no_shadow and args.align_period > 1 else [])
    for workers, predictor in runs:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "row.json"
            shadow = predictor is not None and predictor.startswith("shadow")
            grouped = predictor == "group"  # a prompt's calls on each layer's group only (--worker-prefill group)
            predictor = None if grouped else predictor
            words = predictor.split() if shadow else []
            align, kv = int(words[1]) if len(words) > 1 else 1, int(words[2]) if len(words) > 2 else 0
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(workers + 1 + shadow), "-m", "benchmarks.workers", "--budget", args.budget, "--prompts",
                   str(args.prompts), "--tokens", str(args.tokens), "--rank-out", str(out)] + \
                (["--rank-shadow", "--rank-align", str(align), "--rank-kv-align", str(kv)] if shadow else
                 ["--rank-predictor", predictor] if predictor else ["--rank-prefill", "group"] if grouped else [])
            t0 = time.perf_counter()
            run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if run.returncode != 0:
                raise SystemExit(run.stderr[-3000:])
            row = json.loads(out.read_text())
        stats = [w for rank, w in row.pop("workers").items() if not (shadow and rank == "1")]
        hits, misses = sum(w["hits"] for w in stats), sum(w["misses"] for w in stats)
        routed = sum(w["routed"] for w in stats)
        ahead = f" running {align - 1} passes ahead (--align-period {align})" if align > 1 else ""
        ahead += ", its KV cache realigned every pass (--kv-align-period 1)" if shadow and kv else ""
        row |= {"run": f"{workers} workers" + (f", a shadow rank{ahead}" if shadow else f", {predictor} prefetch"
                                                if predictor else ", prompts on each layer's group (--worker-prefill "
                                                "group)" if grouped else ""),
                "forecast_recall": sum(w["forecast"] for w in stats) / routed if routed and (shadow or predictor)
                else None,
                "bytes_disk": sum(w["bytes_disk"] for w in stats),
                "hit_rate": hits / max(hits + misses, 1), "wall_s": time.perf_counter() - t0}
        rows.append(row)
    for r in rows:
        r["MiB_per_token"] = r["bytes_disk"] / 2**20 / max(r["generated"], 1)
        r["same_tokens"] = r["tokens"] == rows[0]["tokens"]
        r["vs_1_process"] = r["decode_tok_s"] / rows[0]["decode_tok_s"]
    return rows


def shadow_recall(args: argparse.Namespace) -> dict:
    """Per MoE layer, the share of the full model's top-k the int8 shadow's top-k holds, over the same tokens."""
    from moepager.runtime.llm import LLM
    from moepager.runtime.sampling import SamplingParams
    from moepager.trace.format import TraceReader

    _, validation = demo_documents()
    full = LLM(show_progress=False)
    token_ids = [ids[:128] for ids in (full.encode(d) for d in validation[: args.shadow_docs]) if len(ids) >= 16]
    ids = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in (("full", EngineConfig()), ("shadow", EngineConfig(experts=ExpertFormat("int8"),
                                                                                dense_dtype="int8"))):
            llm = full if name == "full" else LLM(config=config, show_progress=False)
            path = Path(tmp) / f"{name}.mpt"
            llm.generate(token_ids, SamplingParams(max_tokens=1), record_trace=path)
            with TraceReader(path) as reader:
                ids[name] = np.concatenate([reader.request(i).ids_TLK for i in range(len(reader))])
    a, b = ids["full"], ids["shadow"]
    k = a.shape[2]
    hits = (a[:, :, :, None] == b[:, :, None, :]).any(-1).sum(-1)  # [T, L]: the full top-k found in the shadow's
    per_layer = (hits / k).mean(0)
    return {"tokens": int(a.shape[0]), "recall_per_layer": per_layer.round(4).tolist(),
            "recall": float(per_layer.mean())}


PROMPT_TOKENS = 32
"""Part 2b's prompt: each document's first tokens."""
KV_PERIODS = (0, 1, 4)
"""Part 2b's KV alignment periods (0: never; the paper's default 1, and its Fig. 10 optimum 4 with slower workers)."""


class _Routing:
    """A routing observer keeping each MoE layer's top-k of the last pass."""

    def __init__(self) -> None:
        self.ids: list[torch.Tensor] = []

    def stage(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> Sequence[torch.Tensor]:
        return ()

    def routed(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision, staged: Sequence[torch.Tensor]) -> None:
        assert route.ids_host_TK is not None
        self.ids.append(route.ids_host_TK.clone())


def shadow_recall_kv(args: argparse.Namespace) -> dict:
    """OD-MoE's decode with KV alignment (experts/remote/kv_align.py), teacher-forced: per validation document its first
    `PROMPT_TOKENS` tokens as the prompt, then its next `--kv-tokens` tokens one decode pass each, on the full
    built-in model and on its int8 shadow, the shadow's cache overwritten with the full model's entries every K
    passes (`KV_PERIODS`; what the main rank's feed sends). Per K, the recall of the full model's top-k in the
    shadow's over the decode passes (OD-MoE's Fig. 6 measures the same, token alignment every pass)."""
    from moepager.checkpoints.default import default_model_path
    from moepager.experts.remote.kv_align import KVAligner
    from moepager.runtime.builder import build
    from moepager.runtime.kv_pool import KVBlockPool
    from moepager.runtime.runner import ModelRunner
    from moepager.runtime.scheduler import Scheduled
    from moepager.runtime.shadow import ShadowRequest
    from moepager.runtime.tokenizer import Tokenizer
    from moepager.types import PassInfo

    path = default_model_path()
    tokenizer = Tokenizer(path)
    _, validation = demo_documents()
    need = PROMPT_TOKENS + args.kv_tokens
    docs = [ids[:need] for ids in (tokenizer.encode(d) for d in validation[: args.shadow_docs]) if len(ids) >= need]

    def runner(config: EngineConfig) -> tuple[ModelRunner, KVBlockPool, _Routing]:
        loaded = build(config, path, False).loaded
        pool = KVBlockPool(loaded.model, loaded.dtype, loaded.device, need + 16, 16)
        routing = _Routing()
        loaded.model.observe_routing(routing)
        return ModelRunner(loaded.model, pool, loaded.device), pool, routing

    def run(r: tuple[ModelRunner, KVBlockPool, _Routing], row: ShadowRequest, start: int, count: int
            ) -> list[torch.Tensor]:
        r[2].ids = []
        assert r[1].reserve(row.blocks, start + count)
        r[0].run([Scheduled(row, start, count, count == 1)])
        return r[2].ids

    full = runner(EngineConfig(model=str(path)))
    shadow = runner(EngineConfig(model=str(path), experts=ExpertFormat("int8"), dense_dtype="int8"))
    found = {k: [] for k in KV_PERIODS}
    for i, ids in enumerate(docs):
        ours, truth = ShadowRequest(i, list(ids)), []
        run(full, ours, 0, PROMPT_TOKENS)
        for t in range(PROMPT_TOKENS, need):
            truth.append(run(full, ours, t, 1))
        for k in KV_PERIODS:  # the shadow over the same tokens, its cache aligned every k passes
            theirs, aligner = ShadowRequest(i, list(ids)), KVAligner(k or 1)
            run(shadow, theirs, 0, PROMPT_TOKENS)
            aligner.spans(PassInfo(0, "prefill", (i,), (0,), (PROMPT_TOKENS,), ("prefill",), torch.empty(0),
                                   (ours.blocks,)))
            for n, t in enumerate(range(PROMPT_TOKENS, need), start=1):
                if k:
                    aligned = aligner.payload(PassInfo(n, "decode", (i,), (t,), (1,), ("decode",), torch.empty(0),
                                                       (ours.blocks,)), full[1])
                    if aligned is not None:
                        spans, entries = aligned
                        at = [slots(theirs.blocks, s, c, shadow[1].block_size) for _, s, c in spans.tolist()]
                        write(shadow[1].cache, torch.cat(at), entries)
                guess = run(shadow, theirs, t, 1)
                found[k] += [(a[:, :, None] == b[:, None, :]).any(-1).float().mean().item()
                             for a, b in zip(truth[n - 1], guess, strict=True)]
            shadow[1].release(theirs.blocks)
        full[1].release(ours.blocks)
    return {"docs": len(docs), "prompt_tokens": PROMPT_TOKENS, "decode_tokens": args.kv_tokens,
            "recall": {str(k): float(np.mean(v)) for k, v in found.items()}}


PAPER_MAIN_LAYER_S = 0.25e-3
"""t_M of Mixtral-8x7B on an RTX 3090: one layer's attention weights (84 MB) read at its memory speed, with the gate
and norms (an estimate: the paper gives per-layer times only in sum)."""


def modeled_scaling() -> list[dict]:
    """OD-MoE's pipeline on paper (planning/od_moe.py) over the Mixtral-8x7B decode traces, with the paper's
    figures: RTX 3090 workers and main node, PCIe 4.0 host links, 1 Gbps Ethernet, groups of 2; the shadow's recall
    the paper's INT8 97.34%, the built-in model's measured int8 recall, or none. Against every expert in one RTX 3090's
    memory."""
    from benchmarks.common import SHARED, converted
    from moepager.experts.remote.placement import Placement
    from moepager.planning.cost import DEVICES, LINKS
    from moepager.planning.od_moe import Cluster, crowded_calls, resident_step_times, step_times, worker_shares
    from moepager.trace.workload import load_workload

    trace = converted("mixtral-jsonl", SHARED / "mixtral-8x7b" / "routing_data_collected", "mixtral-8x7b")
    work = load_workload(str(trace), "decode")
    h = work.header
    routed = work.routed_SLE()
    requested, tokens = routed.sum(2), np.diff(work.step_ptr)
    hidden_bytes = 4096 * 2
    gpu = DEVICES["rtx3090"]
    resident = resident_step_times(gpu, PAPER_MAIN_LAYER_S, requested, tokens, h.expert_bytes, h.top_k).mean()
    rows = []
    for workers in (2, 4, 8, 16):
        for assign in ("one-to-one", "fixed"):
            share = worker_shares(routed, Placement.of(workers, 2, assign))
            crowded = crowded_calls(share, requested, 2)
            for label, recall in (("none", 0.0), ("paper's int8, 97.34%", 0.9734),
                                  ("built-in's int8, 99.51%", 0.9951)):
                cluster = Cluster(workers, 2, gpu, LINKS["pcie4"], LINKS["1gbe"], PAPER_MAIN_LAYER_S, recall)
                t = step_times(cluster, requested, tokens, h.expert_bytes, hidden_bytes, h.top_k,
                               share_SL=share).mean()
                rows.append({"workers": workers, "assign": assign, "crowded_calls": crowded, "shadow": label,
                             "tok_s": 1 / t, "vs_all_in_gpu": resident / t, "all_in_gpu_tok_s": 1 / resident})
    return rows


def modeled_prefill() -> list[dict]:
    """OD-MoE's prefill on paper (planning/od_moe.py `prefill_times`) over the prompts of the DeepSeek-V2-Lite trace's
    first 200 requests (the Mixtral traces are decode only), the nodes of `modeled_scaling`: a prompt's layer calls
    spread over every worker against kept to each layer's group of 2, for 2, 4, 8 and 16 workers (each prompt one
    chunk; the trace's own expert size and top-k)."""
    from benchmarks.common import SHARED, converted
    from moepager.experts.remote.placement import Placement
    from moepager.planning.cost import DEVICES, LINKS
    from moepager.planning.od_moe import Cluster, prefill_times, worker_shares
    from moepager.trace.workload import load_workload

    trace = converted("deepseek-csv", SHARED / "deepseek-v2-lite", "deepseek-v2-lite")
    work = load_workload(str(trace), "recorded", requests=slice(0, 200))
    prompts = work.step_phase == 0
    routed = work.routed_SLE()[prompts]
    requested, tokens = routed.sum(2), np.diff(work.step_ptr)[prompts]
    h, gpu = work.header, DEVICES["rtx3090"]
    rows = []
    for workers in (2, 4, 8, 16):
        cluster = Cluster(workers, 2, gpu, LINKS["pcie4"], LINKS["1gbe"], PAPER_MAIN_LAYER_S, 0.0)
        times = {}
        for mode in ("spread", "group"):
            share = worker_shares(routed, Placement.of(workers, 2, prefill=mode), "prefill")
            times[mode] = float(prefill_times(cluster, requested, tokens, h.expert_bytes, 4096 * 2, h.top_k,
                                              share).mean())
        rows.append({"workers": workers, "prompts": int(prompts.sum()), "mean_prompt_tokens": float(tokens.mean()),
                     "spread_s": times["spread"], "group_s": times["group"],
                     "spread_vs_group": times["spread"] / times["group"]})
    return rows


def main() -> None:
    args = arguments().parse_args()
    if args.rank_out:
        sys.exit(rank_main(args))
    state = machine_state()
    rows = measured(args)
    print(f"built-in model, expert memory {args.budget} in all, {args.prompts} prompts x {args.tokens} tokens, "
          "one thread a process:")
    print_table(["run", "TTFT ms", "decode tok/s", "x 1 process", "TPOT ms", "MiB read / token", "hit %",
                 "forecast named %", "same tokens"],
                [[r["run"], r["ttft_ms"], r["decode_tok_s"], r["vs_1_process"], r["tpot_ms"], r["MiB_per_token"],
                  100 * (r["hit_rate"] or 0),
                  "-" if r.get("forecast_recall") is None else 100 * r["forecast_recall"], r["same_tokens"]]
                 for r in rows])
    recall = shadow_recall(args)
    print(f"\nint8 shadow (int8 experts and dense projections) against the full built-in model, {recall['tokens']} "
          f"tokens: recall of the top-k {100 * recall['recall']:.2f}%, per layer "
          + " ".join(f"{100 * r:.1f}" for r in recall["recall_per_layer"]))
    kv = shadow_recall_kv(args)
    print(f"\nthe int8 shadow decoding {kv['docs']} documents ({kv['prompt_tokens']}-token prompts, then "
          f"{kv['decode_tokens']} teacher-forced decode passes), recall of the full model's top-k with its KV cache "
          "aligned every K passes: " + ", ".join(f"K = {k}: {100 * r:.2f}%" if k != "0" else f"never: {100 * r:.2f}%"
                                                  for k, r in kv["recall"].items()))
    for r in rows:
        r.pop("tokens")
    scaling = modeled_scaling()
    print(f"\nmodeled, Mixtral-8x7B decode traces, the paper's nodes (RTX 3090, PCIe 4.0, 1 Gbps LAN, groups of 2); "
          f"all in one GPU's memory: {scaling[0]['all_in_gpu_tok_s']:.1f} tok/s")
    print_table(["workers", "assign", "calls crowded %", "shadow recall", "tok/s", "x all in GPU"],
                [[r["workers"], r["assign"], 100 * r["crowded_calls"], r["shadow"], r["tok_s"], r["vs_all_in_gpu"]]
                 for r in scaling])
    prefill = modeled_prefill()
    print(f"\nmodeled prefill, {prefill[0]['prompts']} prompts of the DeepSeek-V2-Lite trace (mean "
          f"{prefill[0]['mean_prompt_tokens']:.0f} tokens), the same nodes, every expert loaded on demand:")
    print_table(["workers", "spread s / prompt", "group s / prompt", "spread / group"],
                [[r["workers"], r["spread_s"], r["group_s"], r["spread_vs_group"]] for r in prefill])
    out = write_json("workers", {"machine": state, "args": vars(args), "rows": rows, "shadow": recall,
                                 "shadow_kv_alignment": kv, "modeled_scaling": scaling, "modeled_prefill": prefill})
    print(f"results: {out}")


if __name__ == "__main__":
    main()
