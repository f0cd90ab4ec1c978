"""`moepager generate [--model PATH] PROMPT ...`: generate, stream text, print the run's statistics."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import psutil

from moepager.atomic_io import check_file
from moepager.checkpoints.default import default_model_path
from moepager.cli.launch import launch_workers, starts_workers
from moepager.config import (
    BATCH_POLICIES,
    DENSE_DTYPES,
    EXECUTIONS,
    EXPERT_DTYPES,
    HYBRID_PREFILLS,
    INT4_GROUPS,
    KERNELS,
    WORKER_ASSIGNS,
    WORKER_PREFILLS,
    EngineConfig,
    ExpertFormat,
    PlacementConfig,
    PrefetchConfig,
    RemoteConfig,
    SchedulerConfig,
    StoreConfig,
    fit_decides,
)
from moepager.errors import MoepagerError
from moepager.experts.remote.placement import Links
from moepager.loading.build import read_config
from moepager.policies import ENGINE_POLICIES
from moepager.policies.prefetch import PREFETCH_POLICIES
from moepager.predictors import ONLINE, PREDICTORS
from moepager.runtime.llm import LLM
from moepager.runtime.replay import ReplaySpec, check_record_path, load_replay
from moepager.runtime.sampling import SamplingParams, llama_cpp_sampling

HELP = "generate text for one or more prompts (batched together) and print the run's statistics"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", metavar="PROMPT")
    p.add_argument("--prompt-file", action="append", default=[], metavar="PATH",
                   help="read a prompt from this file, or from standard input with '-' (repeatable; each is one "
                        "prompt)")
    p.add_argument("--model", help="Hugging Face checkpoint directory (default: the built-in demo model)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens to generate per prompt (default 64; with --route-from: the trace's decode steps + 1)")
    add_sampling_arguments(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    add_engine_arguments(p)
    add_replay_arguments(p)
    p.add_argument("--stats-json", metavar="PATH", help="also write the statistics as JSON")
    p.add_argument("--record-trace", metavar="PATH",
                   help="write every token's routing (ids, weights, full gate scores) as a trace file")
    p.add_argument("--record-hidden", action="store_true",
                   help="with --record-trace: also record every router input (float16; token-wise predictor training)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--force", action="store_true", help="replace an existing --stats-json or --record-trace file")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (default: llama.cpp's, temperature 0.8, top-k 40, top-p 0.95, min-p 0.05; "
                             "--temperature 0 is greedy)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=None, help="default 40; 0 disables")
    g.add_argument("--top-p", type=float, default=None, help="default 0.95; 1 disables")
    g.add_argument("--min-p", type=float, default=None, help="default 0.05; 0 disables")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="over the prompt and output (1 disables)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the output (-2..2)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, over the output (-2..2)")
    g.add_argument("--seed", type=int, default=None, help="seed of the sampler (default: random)")


def sampling_params(args: argparse.Namespace, max_tokens: int, **more: object) -> SamplingParams:
    """The sampling options, llama.cpp's defaults filling what is not given (none of them when greedy)."""
    return llama_cpp_sampling(args.temperature, args.top_k, args.top_p, args.min_p, max_tokens=max_tokens,
                              repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, seed=args.seed, **more)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Where the model runs and how its experts and requests are held (generate, serve, chat)."""
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="convert weights (default: as stored)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.set_defaults(threads_note="")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: the cores other processes leave idle, measured at start: torch's "
                        "threads spin against a busy core)")
    p.add_argument("--expert-kernel", choices=KERNELS, default="auto",
                   help="how a layer's routed experts are computed: auto (CPU: the fused kernel where it applies, "
                        "else loop for one token and grouped for more; CUDA: grouped), loop, gather, grouped, packed "
                        "(CPU, every expert resident, weights prepacked at load: bf16 through oneDNN, int8 through "
                        "FBGEMM with activations quantized to 8 bits (lossier); not bit-equal to loop), or fused "
                        "(CPU, bf16/int8/int4: moepager's AVX512 kernel, a whole layer in one call, int8/int4 with "
                        "8-bit activations; `moepager info` says whether this machine has it)")
    add_execution_arguments(p)
    p.add_argument("--no-packed-dense", dest="pack_dense", action="store_false",
                   help="CPU, bf16: compute the dense part of the step with torch's own ops: its GEMV for the "
                        "projections (attention, LM head) instead of moepager's (or, without its CPU kernels, oneDNN "
                        "on weights prepacked at load), and torch's norms, routers and decode attention instead of "
                        "moepager's one call a layer")
    p.add_argument("--compile", action="store_true",
                   help="CPU: compile the decode step with TorchInductor (when the model loads: tens of "
                        "seconds, less once cached on disk; not bit-equal to the eager step). Resident float, int8 "
                        "or int4 experts up to 1 MiB compute inside the graph (the built-in model decodes 2.4x faster "
                        "at one thread); paged, packed or larger experts run eagerly between its parts (1.3x at a "
                        "25%% budget); so do prepacked projections (qwen3-30b-a3b geometry: 1.02x eager). Batched "
                        "decodes of concurrent requests compile too (serve compiles them at start)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="CUDA: launch every kernel of a decode step from Python instead of replaying it as a CUDA "
                        "graph (graphs apply when every expert is resident in bf16 and nothing observes routing; "
                        "same tokens either way)")
    q = p.add_argument_group("quantized experts (lossy, opt-in)")
    q.add_argument("--expert-dtype", choices=EXPERT_DTYPES,
                   help="format of the routed experts: int8 (per-channel scales) or int4 (group scales) quantize "
                        "them when loaded; bf16/fp16/fp32 (must equal --dtype) dequantize a quantized checkpoint "
                        "(default: as stored). Attention, router, norms, embeddings and LM head keep --dtype "
                        "(see --dense-dtype)")
    q.add_argument("--int4-group", type=int, choices=INT4_GROUPS, help="int4: input elements per scale (default 32)")
    q.add_argument("--int4-zero-points", action="store_const", const=True, default=None,
                   help="int4: a zero point per group (default: symmetric, llama.cpp's Q4_0)")
    q.add_argument("--dense-dtype", choices=DENSE_DTYPES,
                   help="int8: the dense projections (attention, dense and shared MLPs, LM head) as int8 with "
                        "per-channel scales too (lossy); int8-a8 (CPU): the same weights computed by moepager's VNNI "
                        "GEMV (bf16 runs, where built) or FBGEMM with activations quantized to 8 bits as well "
                        "(lossier, faster on large matrices); routers, "
                        "norms and embeddings keep --dtype")
    g = p.add_argument_group("continuous batching")
    defaults = SchedulerConfig()
    g.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs, help="most requests in one step")
    g.add_argument("--max-batched-tokens", type=int, default=defaults.max_batched_tokens,
                   help="most tokens one step computes (prompts are chunked to fit)")
    g.add_argument("--kv-cache-tokens", type=int, default=defaults.kv_cache_tokens,
                   help="KV cache positions shared by the running requests (the youngest is preempted when full)")
    g.add_argument("--batch-policy", choices=BATCH_POLICIES, default=defaults.batch_policy,
                   help="which running requests decode together: fifo (all, every step) or expertflow (ExpertFlow's "
                        "token scheduler: twice --max-num-seqs requests run, as two groups of similar routing paths "
                        "that decode in turns, so each step activates fewer distinct experts; a request sits out at "
                        "most one step in a row)")
    g.add_argument("--deterministic", action="store_true",
                   help="batch-invariant: each request computed in a pass of its own and its prompt in fixed chunks, "
                        "so its tokens never depend on what else runs (at the cost of batching's throughput)")
    add_store_arguments(p)
    add_prefetch_arguments(p)


def add_execution_arguments(p: argparse.ArgumentParser) -> None:
    """Where routed experts compute: hybrid CPU/GPU execution and worker processes (generate, serve, chat)."""
    h = p.add_argument_group("where experts compute (CPU and GPU)")
    h.add_argument("--execution", choices=EXECUTIONS, default="gpu",
                   help="gpu: every routed expert computes on --device, a missing one copied in first; hybrid: a "
                        "missing expert computes on the CPU in host memory, at the same time as the device computes "
                        "its hits, unless copying it pays (SMoE: a prefill's heavy experts), needs --expert-memory; "
                        "cpu-experts: every routed expert on the CPU, attention and dense layers on --device "
                        "(llama.cpp's --cpu-moe; --host-memory budgets their RAM); auto: chosen from the cost model "
                        "(--profile), and the run says why")
    h.add_argument("--hybrid-admit", type=int, default=0, metavar="N",
                   help="hybrid: copy up to N of each layer's experts computed on the CPU to the device in the "
                        "background, so the cache follows the routing (default 0: it changes only through a "
                        "prefill's heavy experts and --predictor prefetches, as SMoE's)")
    h.add_argument("--hybrid-prefill", choices=HYBRID_PREFILLS, default="ping-pong",
                   help="hybrid: a prefill's experts placed on the device pass through two stream rows and leave the "
                        "decode cache alone, which the first decode pass then fills with each layer's most activated "
                        "experts (ping-pong, SMoE's; default), or go through the cache's slots (cache)")
    w = p.add_argument_group("worker processes (OD-MoE)")
    w.add_argument("--workers", type=int, default=0, metavar="N",
                   help="N worker processes hold and compute the routed experts (started on this machine, gloo): "
                        "this process keeps the dense weights and the KV cache")
    w.add_argument("--worker-group", type=int, metavar="G",
                   help="--workers: workers sharing one MoE layer's experts (default min(top-k, N)); layers go "
                        "round-robin to the N/G groups")
    w.add_argument("--worker-memory", metavar="SIZE",
                   help="--workers: each worker's expert cache, a size or a share of its own experts (25%%); the rest "
                        "read from the checkpoint on demand (default: all of its experts in RAM)")
    w.add_argument("--worker-assign", choices=WORKER_ASSIGNS,
                   help="--workers: how a layer call's routed experts go to its group's workers: one-to-one (OD-MoE's: "
                        "none takes more than its share, so at one token no two share a worker; resident workers "
                        "then hold their group's layers whole) or fixed (each expert on one worker only); default "
                        "one-to-one with --worker-memory, fixed without")
    w.add_argument("--worker-prefill", choices=WORKER_PREFILLS,
                   help="--workers: who computes a prompt's layer calls: spread (OD-MoE's: expert e of every layer on "
                        "worker e mod N, so all N workers compute every layer) or group (the layer's group, as in "
                        "decode); default spread with --worker-memory, group without")
    w.add_argument("--shadow", action="store_true",
                   help="--workers: one more process runs the model's int8 copy on each pass as it starts and sends "
                        "every layer's routing to the workers to load ahead (OD-MoE's shadow model)")
    w.add_argument("--align-period", type=int, default=1, metavar="P",
                   help="--shadow: the shadow runs up to P-1 passes ahead on its own greedy tokens, forecasting their "
                        "routing earlier, realigned with the real tokens at every pass (default 1: never ahead)")
    w.add_argument("--kv-align-period", type=int, default=0, metavar="P",
                   help="--shadow: every P-th pass the main process sends the shadow its KV cache entries computed "
                        "since it last did, which replace the shadow's int8-computed ones (OD-MoE's KV alignment, "
                        "whose default is 1; default 0: never, which measured no worse)")
    w.add_argument("--on-worker-loss", choices=["stop", "failover"], default="stop",
                   help="--workers: a worker that dies or stops answering stops the run with an error naming it "
                        "(stop), or its experts go to the workers left and the run goes on (failover)")
    w.add_argument("--worker-timeout", type=float, default=60.0, metavar="S",
                   help="--workers: seconds to wait for a worker's answer before stopping with an error naming it")
    h.add_argument("--cpu-threads", type=int, metavar="N",
                   help="hybrid, cpu-experts: torch threads of the thread computing experts on the CPU (default "
                        "--threads)")
    h.add_argument("--profile", metavar="FILE.json",
                   help="a profile from `moepager calibrate --out`, or a built-in one's name (rtx4090-pcie4, ...), "
                        "that hybrid placement, --execution auto and --configure auto take their costs from (default: "
                        "nominal figures for the device's kind); on a CPU run a device's profile makes the CPU stand "
                        "in for that device (its copies and ping-pong rows, computed on the CPU)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                                batch_policy=args.batch_policy,
                                kv_cache_tokens=args.kv_cache_tokens, batch_invariant=args.deterministic)
    threads = args.threads
    if threads is None and args.device == "cpu":
        threads, args.threads_note = idle_cores()
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, threads=threads,
                        store=store_config(args), prefetch=prefetch_config(args), expert_kernel=args.expert_kernel,
                        scheduler=scheduler, dense_dtype=args.dense_dtype,
                        experts=ExpertFormat(args.expert_dtype, args.int4_group, args.int4_zero_points),
                        pack_dense=args.pack_dense, compile=args.compile, cuda_graphs=args.cuda_graphs,
                        placement=PlacementConfig(execution=args.execution, cpu_threads=args.cpu_threads,
                                                  profile=args.profile, hybrid_admit=args.hybrid_admit,
                                                  hybrid_prefill=args.hybrid_prefill),
                        remote=RemoteConfig(workers=args.workers, worker_group=args.worker_group,
                                            worker_timeout_s=args.worker_timeout, worker_memory=args.worker_memory,
                                            on_worker_loss=args.on_worker_loss, shadow=args.shadow,
                                            align_period=args.align_period,
                                            kv_align_period=args.kv_align_period, worker_assign=args.worker_assign,
                                            worker_prefill=args.worker_prefill))


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("expert memory (default: every expert resident)")
    g.add_argument("--expert-memory", metavar="SIZE",
                   help="device expert cache, e.g. 6GiB, 800MB, 25%% of all experts; the rest is paged in")
    g.add_argument("--host-memory", metavar="SIZE",
                   help="with --device cuda: pinned host RAM for experts (default all); the rest is read from disk")
    g.add_argument("--policy", choices=ENGINE_POLICIES,
                   help="eviction policy (default lrfu: recency and frequency combined; lru: the last use only; fmoe, "
                        "plec and plec-lrfu rank with the --predictor's forecasts)")
    g.add_argument("--cache-scope", choices=["layer", "global"],
                   help="layer: equal share of the cache per MoE layer (default); global: shared by all layers")
    g.add_argument("--io-threads", type=int, help="threads reading experts from disk (default 4)")
    g.add_argument("--direct-io", choices=["auto", "on", "off"],
                   help="O_DIRECT disk reads (auto, the default: where the file system allows; off: page cache, "
                        "then dropped)")
    g.add_argument("--cold", action="store_true", help="start with an empty expert cache")
    g.add_argument("--layer-plan", metavar="PLAN.json",
                   help="split the --expert-memory cache between MoE layers in proportion to the per-layer budgets of "
                        "`moepager plan --json PLAN.json` (MoEpic's configurator) instead of evenly; its split ratios "
                        "need a `moepager split` checkpoint (or plan with --whole-experts)")
    g.add_argument("--configure", choices=["off", "auto"],
                   help="auto: choose each MoE layer's share of the cache (and, on a split checkpoint, its split "
                        "ratio) again every --configure-every decode tokens from their recent routing (MoEpic's "
                        "configurator online; outputs do not change); default off")
    g.add_argument("--configure-every", type=int, metavar="TOKENS",
                   help="--configure auto: decode tokens between reconfigurations (default 5000, MoEpic's τ)")


def add_prefetch_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing prediction and prefetch (needs --expert-memory)")
    g.add_argument("--predictor", choices=PREDICTORS,
                   help="forecast routing and load experts ahead (outputs do not change)")
    g.add_argument("--predictor-file", metavar="PATH", help="fitted predictor (`moepager predictor fit`)")
    g.add_argument("--prefetch-distance", type=int, metavar="D",
                   help="MoE layers between forecast and target (default: transition/gate-lookahead 1, "
                        "expert-map 3, token-wise one token)")
    g.add_argument("--prefetch-k", type=int, metavar="K",
                   help="experts prefetched per forecast row (default: head 1, others top-k; 0: none, the forecasts "
                        "only rank evictions for --policy fmoe/plec/plec-lrfu)")
    g.add_argument("--prefetch-inflight", type=int, metavar="N", help="prefetches loading at once (default 2 x top-k)")
    g.add_argument("--prefetch-fixed", action="store_true",
                   help="SMoE's Fixed-N: each forecast loads exactly --prefetch-k experts not yet cached a layer, "
                        "walking down its ranking past the cached ones (default: its top --prefetch-k, loading those "
                        "not cached: SMoE's Adaptive-N)")
    g.add_argument("--prefetch-flex", action="store_true",
                   help="SMoE-Flex: after the first 32 forward passes, stop prefetching for the half of the MoE layers "
                        "whose forecasts were least accurate (the paper gives the others --prefetch-k 3)")
    g.add_argument("--prefetch-min-p", type=float, metavar="P",
                   help="prefetch a selected expert only when its forecast probability is at least P (default: "
                        "head 0.5, the experts it finds more likely than not; others 0)")
    g.add_argument("--prefetch-threads", type=int, metavar="N",
                   help="threads reading prefetches (default 1; more read ahead sooner and waste more of the link "
                        "on wrong forecasts)")
    g.add_argument("--prefetch-no-yield", action="store_true",
                   help="a prefetch that started reads to its end beside demand loads (default: it gives way to them "
                        "between the chunks of its read, and its layer's routing promotes or abandons it)")
    g.add_argument("--prefetch-policy", choices=list(PREFETCH_POLICIES),
                   help="what becomes of prefetches (default expertflow: its layer's routing cancels, promotes or "
                        "marks each stale; plain: every prefetch runs to its end and stays an ordinary resident)")
    g.add_argument("--learn-maps", action="store_true", help="expert-map: add each iteration's map to the store")


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing replay (real routing on a checkpoint of the same geometry; no PROMPT)")
    g.add_argument("--route-from", metavar="TRACE",
                   help="every MoE layer's experts come from this trace, request by request, token by token")
    g.add_argument("--route-requests", metavar="A:B", help="replay these requests of the trace (default: all)")
    g.add_argument("--route-prompt", type=int, metavar="N",
                   help="the first N tokens of each request are its prompt, every later token a decode step "
                        "(traces recorded as one forward pass per prompt, such as DeepSeek-V2-Lite's)")
    g.add_argument("--route-concurrency", type=int, default=1, metavar="N",
                   help="replay N requests at a time, continuously batched (default 1: one after another)")
    g.add_argument("--route-layers", choices=["match", "first"], default="match",
                   help="first: a model with fewer MoE layers replays the trace's first ones (default: they must "
                        "match)")


def replay_spec(args: argparse.Namespace) -> ReplaySpec | None:
    """The replay the options ask for; None without --route-from (its options alone are refused)."""
    if args.route_from is None:
        given = [flag for flag, value in (("--route-requests", args.route_requests),
                                          ("--route-prompt", args.route_prompt),
                                          ("--route-concurrency", None if args.route_concurrency == 1 else 1),
                                          ("--route-layers", None if args.route_layers == "match" else 1)) if value]
        if given:
            raise MoepagerError(f"{', '.join(given)} need --route-from TRACE")
        if not args.prompts:
            raise MoepagerError("give at least one PROMPT (or --route-from TRACE to replay recorded requests)")
        return None
    if args.prompts:
        raise MoepagerError("--route-from replays the trace's own requests; give no PROMPT")
    steps = None if args.max_tokens is None else args.max_tokens - 1
    spec = ReplaySpec(args.route_from, args.route_requests, args.route_prompt, args.route_layers, steps)
    check_record_path(spec, args.record_trace)
    return spec


def prefetch_config(args: argparse.Namespace) -> PrefetchConfig:
    return PrefetchConfig(predictor=args.predictor, file=args.predictor_file, distance=args.prefetch_distance,
                          per_row=args.prefetch_k, max_inflight=args.prefetch_inflight, learn=args.learn_maps,
                          min_p=args.prefetch_min_p, fixed=args.prefetch_fixed,
                          flex=args.prefetch_flex)


def store_config(args: argparse.Namespace) -> StoreConfig:
    given = {name: value for name, value in (("policy", args.policy), ("scope", args.cache_scope),
                                             ("io_threads", args.io_threads), ("direct_io", args.direct_io),
                                             ("prefetch_threads", args.prefetch_threads),
                                             ("prefetch_yields", False if args.prefetch_no_yield else None),
                                             ("prefetch_policy", args.prefetch_policy),
                                             ("layer_plan", args.layer_plan), ("configure", args.configure),
                                             ("configure_every", args.configure_every))
             if value is not None}  # the rest keep StoreConfig's defaults
    return StoreConfig(expert_memory=args.expert_memory, host_memory=args.host_memory, warm=not args.cold, **given)


def refuse_ignored_options(args: argparse.Namespace) -> None:
    """generate's options that would do nothing in this run, then the engine's (`refuse_ignored_engine_options`)."""
    if args.record_trace is None and args.record_hidden:
        raise MoepagerError("--record-hidden does nothing without --record-trace")
    refuse_ignored_engine_options(args)
    if args.record_trace and args.stats_json and Path(args.record_trace).resolve() == Path(args.stats_json).resolve():
        raise MoepagerError("--record-trace and --stats-json name the same file")
    inputs = generate_inputs(args)
    check_file(args.record_trace, "--record-trace", args.force, inputs)
    check_file(args.stats_json, "--stats-json", args.force, inputs)


def generate_inputs(args: argparse.Namespace) -> dict[str, str | None]:
    """What a generate run reads, by the option naming it (an output may be none of them)."""
    model = args.model or str(default_model_path())
    files = {f"--prompt-file {p}": p for p in args.prompt_file if p != "-"}
    return {"--model": model, **files, "--predictor-file": args.predictor_file, "--route-from": args.route_from,
            "--layer-plan": args.layer_plan, "--profile": args.profile}


def refuse_ignored_engine_options(args: argparse.Namespace) -> None:
    """The one rule for engine options (generate, serve, chat) that would do nothing in this run: refuse them,
    saying what they need."""
    paged = args.expert_memory is not None or args.host_memory is not None
    may_page = paged or fit_decides(paged, args.workers, args.execution)  # no budget: the fit may page them
    needs = [
        (not may_page, "a paged store (--expert-memory or --host-memory)",
         {"--policy": args.policy, "--cache-scope": args.cache_scope, "--io-threads": args.io_threads,
          "--direct-io": args.direct_io, "--cold": args.cold}),
        (args.predictor is None, "--predictor",
         {"--predictor-file": args.predictor_file, "--prefetch-distance": args.prefetch_distance,
          "--prefetch-k": args.prefetch_k, "--prefetch-inflight": args.prefetch_inflight,
          "--prefetch-threads": args.prefetch_threads, "--prefetch-min-p": args.prefetch_min_p,
          "--prefetch-no-yield": args.prefetch_no_yield, "--prefetch-policy": args.prefetch_policy,
          "--learn-maps": args.learn_maps, "--prefetch-fixed": args.prefetch_fixed,
          "--prefetch-flex": args.prefetch_flex}),
        (args.execution == "gpu", "--execution hybrid, cpu-experts or auto", {"--cpu-threads": args.cpu_threads}),
        (args.execution == "gpu" and args.configure != "auto", "--execution hybrid, cpu-experts or auto, or "
         "--configure auto", {"--profile": args.profile}),
        (args.configure != "auto", "--configure auto", {"--configure-every": args.configure_every}),
    ]
    for missing, what, options in needs:
        given = [flag for flag, value in options.items() if value not in (None, False)]
        if missing and given:
            raise MoepagerError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} nothing without {what}")
    if args.learn_maps and args.predictor not in ONLINE:
        raise MoepagerError(f"--learn-maps: the {args.predictor} predictor does not learn online (only "
                            f"{', '.join(ONLINE)} does)")
    check_threads(args.threads)
    check_threads(args.cpu_threads, "--cpu-threads")


BUSY_SAMPLE_S = 0.25
"""How long the CPU's use by other processes is sampled before a command picks its threads."""


def idle_cores() -> tuple[int, str]:
    """The cores other processes leave idle (at least one), and a note saying so when it is fewer than all (what
    `announce_threads` prints once the run has started): torch's OpenMP threads spin while they wait for each other,
    so one that shares a core with a busy process stalls every step (docs/performance-notes.md, "Threads"). This
    process's own use is left out of the sample."""
    cores = os.cpu_count() or 1
    busy = others_busy_cores(cores)
    threads = max(1, cores - int(busy + 0.5))
    note = (f"note: other processes keep ~{busy:.1f} of {cores} cores busy: computing with {threads} thread"
            f"{'s' if threads > 1 else ''} (--threads N overrides)") if threads < cores else ""
    return threads, note


def others_busy_cores(cores: int) -> float:
    """How many of the machine's `cores` other processes kept busy over BUSY_SAMPLE_S (this process left out)."""
    own = psutil.Process()
    before, mine = psutil.cpu_times(), own.cpu_times()
    time.sleep(BUSY_SAMPLE_S)
    after, mine_after = psutil.cpu_times(), own.cpu_times()
    idle = (after.idle + getattr(after, "iowait", 0.0)) - (before.idle + getattr(before, "iowait", 0.0))
    total = sum(after) - sum(before)
    ours = (mine_after.user + mine_after.system) - (mine.user + mine.system)
    return max(0.0, (total - idle - ours) / total * cores) if total > 0 else 0.0


def announce_threads(args: argparse.Namespace) -> None:
    """The threads note of `idle_cores`, once the model has loaded and (generate) the prompts were accepted: an error
    before it stays one line. Said once."""
    if args.threads_note:
        print(args.threads_note, file=sys.stderr)
        args.threads_note = ""


def check_threads(threads: int | None, flag: str = "--threads") -> None:
    """Refuse --threads below 1 or above the machine's cores (every command that takes it)."""
    cores = os.cpu_count() or 1
    if threads is not None and threads < 1:
        raise MoepagerError(f"{flag} must be >= 1, got {threads}")
    if threads is not None and threads > cores:
        raise MoepagerError(f"{flag} {threads} is more than this machine's {cores} CPU cores; oversubscribed "
                            f"threads make every step wait for the others (10-100x slower): use at most {cores}")


def read_prompts(args: argparse.Namespace) -> list[str]:
    """PROMPT arguments, then each --prompt-file (or '-' for stdin); bytes that are not UTF-8 are replaced,
    with a warning."""
    prompts = [utf8(p.encode("utf-8", "surrogateescape"), "a PROMPT argument") for p in args.prompts]
    for name in args.prompt_file:
        try:
            with (open(0, "rb", closefd=False) if name == "-" else open(name, "rb")) as f:
                data = f.read(MAX_PROMPT_BYTES + 1)  # (/dev/zero never ends)
        except OSError as e:
            raise MoepagerError(f"--prompt-file {name}: {e.strerror or e}") from None
        if len(data) > MAX_PROMPT_BYTES:
            raise MoepagerError(f"--prompt-file {name} holds more than {MAX_PROMPT_BYTES >> 20} MiB: no model's "
                                "context takes a prompt that long")
        prompts.append(utf8(data, f"--prompt-file {name}"))
    return prompts


MAX_PROMPT_BYTES = 64 << 20  # the largest prompt file read: some 16M tokens, past every supported model's context


def utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        print(f"warning: {where} is not valid UTF-8 (byte {e.start}); undecodable bytes were replaced with U+FFFD",
              file=sys.stderr)
        return data.decode("utf-8", errors="replace")


def run(args: argparse.Namespace, links: Links = Links()) -> int:
    """`links`: the worker ranks' process groups, on the main rank of a --workers run (distributed/__main__.py)."""
    if starts_workers(args):  # start the worker processes: this command runs again as each rank
        replay_spec(args)
        refuse_ignored_options(args)
        return launch_workers(args, engine_config(args))
    args.prompts = read_prompts(args)
    refuse_ignored_options(args)
    replay = replay_spec(args)
    params = sampling_params(args, 64 if args.max_tokens is None else args.max_tokens, stop=tuple(args.stop),
                             ignore_eos=args.ignore_eos)
    if replay is not None:  # a trace that cannot replay on this model is refused before the model loads
        load_replay(replay, read_config(args.model or default_model_path()))
    llm = LLM(config=engine_config(args), show_progress=not args.quiet, links=links)
    if replay is not None:
        announce_threads(args)
        return _replay(llm, replay, params, args)
    if llm.tokenizer is None:
        raise MoepagerError("this checkpoint has no tokenizer.json, so text prompts cannot be encoded")
    single = len(args.prompts) == 1
    if not single:  # --compile: the batched graph compiles now, not inside the run its statistics time
        llm.warm_batched_decode()
    echoed = [False]

    def stream(_row: int, text: str) -> None:
        if not echoed[0]:  # the prompt is echoed (and the threads note said) once it has been accepted, not before
            announce_threads(args)
            sys.stdout.write(args.prompts[0])
            echoed[0] = True
        sys.stdout.write(text)
        sys.stdout.flush()

    completions = llm.generate(args.prompts, params, chat=args.chat, on_text=stream if single else None,
                               record_trace=args.record_trace, record_hidden=args.record_hidden)
    if single:
        if not echoed[0]:
            announce_threads(args)
        sys.stdout.write(("" if echoed[0] else args.prompts[0]) + "\n")
    else:
        announce_threads(args)
        for i, (prompt, c) in enumerate(zip(args.prompts, completions)):
            print(f"[{i}] {prompt}{c.text}")
    return _report(llm, args)


def _replay(llm: LLM, spec: ReplaySpec, params: SamplingParams, args: argparse.Namespace) -> int:
    completions = llm.replay(spec, params, record_trace=args.record_trace, record_hidden=args.record_hidden,
                             concurrency=args.route_concurrency)
    print(f"replayed {len(completions)} requests of {spec.trace}: "
          f"{sum(len(c.prompt_token_ids) for c in completions)} prompt tokens, "
          f"{sum(len(c.token_ids) - 1 for c in completions)} decode steps")
    return _report(llm, args)


def _report(llm: LLM, args: argparse.Namespace) -> int:
    """The run's statistics table, and the files asked for."""
    print(f"\n{llm.last_stats.table()}")
    if args.stats_json:
        llm.last_stats.write_json(args.stats_json)
    if args.record_trace:
        print(f"routing trace: {args.record_trace} (replay it: moepager simulate {args.record_trace})")
    return 0
