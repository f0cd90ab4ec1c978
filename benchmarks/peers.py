"""moepager against its peers on the CPU, all experts resident, bf16 or quantized experts: decode tokens/s side by side.

Engines, each in its own process and measured in interleaved rounds (median of per-token times over --decode steps
after a 16-token prompt; the warm-up decode compiles a --compiled row; engines that do not fit in the machine's RAM
together are measured in turns, each format beside its llama.cpp peer, and the run says so up front): moepager
(one row per --kernels entry and --formats entry: bf16, or --expert-dtype int8/int4), HF
transformers (a greedy loop over its DynamicCache; bf16) and llama.cpp through `llama-cpp-python` when it is
installed (`pip install -e ".[peers]"`, which builds llama.cpp from source; on this project's CPU set CMAKE_ARGS
as FACTS.md says, AMX off) on the same weights written by our own `moepager export-gguf`: BF16, or Q8_0/Q4_0
experts with every other tensor bf16 (what moepager's int8/int4 quantize); with --dense and int8 experts also
Q8_0 with the dense projections in Q8_0 too (`export-gguf --dense-type q8_0`: what --dense-dtype int8/int8-a8
quantize), the peer of the moepager rows with int8 experts and int8 dense projections. Our bf16 export is tensor for
tensor what llama.cpp's own convert_hf_to_gguf.py writes. Models: the built-in demo-moe and `make-model --preset
qwen3-30b-a3b --layers 4` (~1.08 GB of weights read per token in bf16). Reports tok/s, the ratios to HF and to
llama.cpp in the same format, and the weight bytes per token divided by the time per token (achieved GB/s).

With --tiers, the moepager rows run on each CPU tier named (accel/cpu_tiers.py: MOEPAGER_CPU_TIER in the engine's
process; a tier below this CPU's best also caps torch's own kernels at it, ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA,
so an AVX-512 host measures what an AVX2 host runs), each beside llama.cpp built for that tier: --llama-cpp
TIER=DIR names a folder llama-cpp-python was installed into (`pip install --target DIR`, built with the CMAKE_ARGS of
FACTS.md for that instruction set); a tier without one is compared with the installed llama-cpp-python.

    python -m benchmarks run peers [--models demo qwen3-30b-a3b] [--threads 1 2] [--rounds 3] [--decode 64]
        [--kernels auto loop gather grouped packed] [--formats bf16 int8 int4] [--dense int8 int8-a8]
        [--unpacked] [--compiled] [--no-hf] [--tiers avx512-bf16 avx2] [--llama-cpp avx2=DIR ...]
        [--out peers]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NamedTuple

import psutil
import torch

from benchmarks.common import RESULTS, bytes_per_decode_token, ensure_model, machine_state, print_table, write_json
from moepager.accel import cpu_tiers
from moepager.checkpoints.default import default_model_path
from moepager.checkpoints.expert_reader import is_routed_expert
from moepager.checkpoints.safetensors import Checkpoint
from moepager.config import DENSE_DTYPES, EngineConfig, ExpertFormat
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams

PROMPT = 16
PAUSE_S = 0.5
"""Idle time before each engine's round: the OpenMP threads of the engine that ran before spin a while after its last
step before they sleep, and on two cores they would take the next engine's."""


class Ours:
    def __init__(self, path: Path, kernel: str, expert_dtype: str | None = None, dense_dtype: str | None = None,
                 pack_dense: bool = True, compile: bool = False):
        self.llm = LLM(config=EngineConfig(model=str(path), expert_kernel=kernel, experts=ExpertFormat(expert_dtype),
                                           dense_dtype=dense_dtype, pack_dense=pack_dense, compile=compile),
                       show_progress=False)

    def tpot(self, ids: list[int], steps: int) -> list[float]:
        self.llm.generate([ids], SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        return list(self.llm.last_stats.tpot_s)


class HF:
    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()

    def tpot(self, ids: list[int], steps: int) -> list[float]:
        from transformers import DynamicCache

        times = []
        with torch.inference_mode():
            cache = DynamicCache(config=self.model.config)
            out = self.model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
            for _ in range(steps):
                start = time.perf_counter()
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                out = self.model(nxt, past_key_values=cache, use_cache=True)
                times.append(time.perf_counter() - start)
        return times


class LlamaCpp:
    def __init__(self, path: Path, gguf_types: tuple[str, str | None], threads: int, site: str | None = None):
        """`site`: a folder holding another build of llama-cpp-python (`pip install --target`), searched first."""
        if site is not None:
            sys.path.insert(0, site)
        import llama_cpp

        from moepager.checkpoints.gguf_write import export_gguf

        gguf_type, dense_type = gguf_types
        gguf = RESULTS / "gguf" / f"{path.name}-{gguf_type}{f'-dense-{dense_type}' if dense_type else ''}.gguf"
        if not gguf.exists():  # our export-gguf (tensor for tensor what llama.cpp's own converter writes in bf16)
            gguf.parent.mkdir(parents=True, exist_ok=True)
            export_gguf(path, gguf, gguf_type, dense_type=dense_type)
        # use_mmap=False: the weights in llama.cpp's own memory, as moepager holds them. Mapped from the page cache,
        # its speed depends on how the file came to be cached: qwen3 L4 Q8_0 at 1 thread decoded 11.8 tok/s just
        # after the file was written and 8.95-9.05 once it had been evicted and read back, 11.09 loaded (ad-hoc probe)
        self.model = llama_cpp.Llama(str(gguf), n_ctx=PROMPT + 512, n_threads=threads, verbose=False, use_mmap=False)
        self.threads = threads

    def tpot(self, ids: list[int], steps: int) -> list[float]:
        self.model.reset()
        self.model.eval(ids)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            token = int(self.model.scores[self.model.n_tokens - 1].argmax())
            self.model.eval([token])
            times.append(time.perf_counter() - start)
        return times


ENGINES = {"ours": Ours, "hf": HF, "llama.cpp": LlamaCpp}


class Facts(NamedTuple):
    """What the parent needs to know of a moepager engine (peers report none)."""

    bytes_per_token: int
    int8_dense: bool
    vocab: int


class Decode(NamedTuple):
    """One timed round a worker is asked for."""

    ids: list[int]
    steps: int
    threads: int


def _serve(kind: str, args: tuple[object, ...], conn: Connection) -> None:
    """A worker process: build one engine, report its facts, then time decodes until told to stop (None)."""
    try:
        engine = ENGINES[kind](*args)
    except Exception as e:  # noqa: BLE001 - handed to the parent, which reports the engine as not measured
        conn.send(RuntimeError(str(e)))
        return
    facts = None
    if isinstance(engine, Ours):
        llm = engine.llm
        facts = Facts(bytes_per_decode_token(llm), llm.config.dense_dtype is not None, llm.loaded.config.vocab_size)
    conn.send(facts)
    while (request := conn.recv()) is not None:
        torch.set_num_threads(request.threads)
        conn.send(engine.tpot(request.ids, request.steps))


class Remote:
    """One engine in a process of its own (spawned). Engines in one process share its OpenMP runtime, and there they
    slowed each other: llama.cpp BF16 at 2 threads on the qwen3 geometry decoded 36-42 tok/s beside a moepager engine
    and 54.7 in its own process (ad-hoc, 2026-11-25), which had flattered moepager's two-thread ratios."""

    def __init__(self, kind: str, *args: object, env: dict[str, str] | None = None):
        """`env`: variables the engine's process starts with (a spawned child copies the parent's environment at its
        start: set here around it, before the child imports torch)."""
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(kind, args, child), daemon=True)
        before = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})
        try:
            self.process.start()
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        reply = self.conn.recv()
        if isinstance(reply, Exception):
            self.process.join()
            raise reply
        self.facts: Facts | None = reply
        self.threads = 1
        """torch's threads for the next decodes (llama.cpp's are fixed when it is built)."""

    def tpot(self, ids: list[int], steps: int) -> list[float]:
        self.conn.send(Decode(ids, steps, self.threads))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.process.join()


def model_path(name: str) -> Path:
    return default_model_path() if name == "demo" else ensure_model(f"{name}-L4", name, 4)


GGUF_TYPES = {"bf16": ("bf16", None), "int8": ("q8_0", None), "int4": ("q4_0", None), "int8+dense": ("q8_0", "q8_0")}
"""Peer format -> export-gguf's (--type, --dense-type); `int8+dense`: int8 experts and int8 dense projections."""
PEER_LABELS = {"bf16": "llama.cpp BF16", "int8": "llama.cpp Q8_0", "int4": "llama.cpp Q4_0",
               "int8+dense": "llama.cpp Q8_0 + dense Q8_0"}


def runs(kernel: str, fmt: str) -> bool:
    """Whether moepager computes `fmt` experts with `kernel` (int8/int4 run auto/loop; packed takes bf16 and int8)."""
    if kernel == "packed":
        return fmt in ("bf16", "int8")
    return fmt == "bf16" or kernel in ("auto", "loop")


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["demo", "qwen3-30b-a3b"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--kernels", nargs="+", default=["auto"], help="moepager expert kernels to run (one row each)")
    ap.add_argument("--formats", nargs="+", default=["bf16"], choices=["bf16", "int8", "int4"],
                    help="expert formats: moepager --expert-dtype F against llama.cpp's BF16/Q8_0/Q4_0 of the same "
                         "weights (experts quantized, the rest bf16: `moepager export-gguf --type`)")
    ap.add_argument("--dense", nargs="+", default=[], choices=DENSE_DTYPES,
                    help="also each moepager row with --dense-dtype D (every projection int8; int8-a8 on FBGEMM with "
                         "8-bit activations); with int8 experts their peer is llama.cpp with dense Q8_0 as well")
    ap.add_argument("--unpacked", action="store_true",
                    help="also each bf16-dense moepager row with --no-packed-dense (torch's own ops for the dense "
                         "part of the step: its GEMV, norms, routers and attention, instead of moepager's CPU kernels)")
    ap.add_argument("--compiled", action="store_true",
                    help="also each moepager row with --compile (the one-token decode step compiled by TorchInductor; "
                         "twice the engines in memory: on the qwen3 geometry ask for one row)")
    ap.add_argument("--no-hf", action="store_true", help="leave transformers out")
    ap.add_argument("--tiers", nargs="+", default=[None], choices=[*cpu_tiers.NAMES, None], metavar="TIER",
                    help="run the moepager rows on each of these CPU tiers (default: the best this CPU runs), each "
                         "beside llama.cpp built for it (--llama-cpp)")
    ap.add_argument("--llama-cpp", nargs="+", default=[], metavar="TIER=DIR",
                    help="llama-cpp-python installed into DIR (pip install --target) is the peer of TIER's rows")
    ap.add_argument("--memory", type=float, metavar="GB",
                    help=f"RAM the engines measured together may take (default {HEADROOM * 100:.0f}%% of what is "
                         "available at the start); more engines than fit are measured in turns")
    ap.add_argument("--out", default="peers", help="results/NAME.json")
    return ap.parse_args()


Engines = dict[str, tuple[str, Remote]]
"""Row label -> (its peer format: bf16, int8, int4 or int8+dense; the engine)."""


class Spec(NamedTuple):
    """An engine to start: its row label, peer format, kind and constructor arguments, and the RAM it will take; the
    CPU tier it runs on (None: the process's own) and the environment that sets it."""

    label: str
    fmt: str
    kind: str
    args: tuple[object, ...]
    nbytes: int
    tier: str | None = None
    env: dict[str, str] | None = None


TORCH_CAP = {"avx2": ("avx2", "AVX2")}
"""A tier below this CPU's best -> the caps on torch's own kernels (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) that make
this CPU look to torch as that tier's CPUs do."""


def tier_env(tier: str | None) -> dict[str, str] | None:
    """The environment of an engine on `tier` (None: the process's own tier, nothing set)."""
    if tier is None:
        return None
    env = {"MOEPAGER_CPU_TIER": tier}
    if tier in TORCH_CAP and cpu_tiers.runnable()[0] != tier:
        env["ATEN_CPU_CAPABILITY"], env["ONEDNN_MAX_CPU_ISA"] = TORCH_CAP[tier]
    return env


def tagged(label: str, tier: str | None, build: bool = False) -> str:
    return label if tier is None else f"{label} [{tier}{' build' if build else ''}]"


EXPERT_SHARE = {"bf16": 1.0, "int8": 0.5 + 1 / 64, "int4": 0.3125, "int8+dense": 0.5 + 1 / 64}
"""Bytes of a routed expert in each format against bf16 (int8: a scale per row; int4: groups of 32, bf16 scales)."""
HEADROOM = 0.75
"""Share of the RAM available at the start that the engines measured together may take (activations, the OS, the
tokenizers and torch's own buffers take the rest)."""


def footprint(path: Path, fmt: str, kind: str) -> int:
    """RAM an engine of `kind` holding the checkpoint at `path` with experts in `fmt` takes, estimated from the
    checkpoint's tensors (bf16 for every dense weight; HF holds everything in bf16), plus 25% for the runtime."""
    ckpt = Checkpoint(path)
    dense = sum(loc.nbytes // loc.dtype.itemsize * 2 for n, loc in ckpt.locations.items() if not is_routed_expert(n))
    experts = sum(loc.nbytes // loc.dtype.itemsize * 2 for n, loc in ckpt.locations.items() if is_routed_expert(n))
    share = 1.0 if kind == "hf" else EXPERT_SHARE[fmt]
    if fmt == "int8+dense" and kind != "hf":
        dense = dense // 2
    return int(1.25 * (dense + share * experts))


def in_turns(specs: list[Spec], budget: int) -> list[list[Spec]]:
    """The engines grouped so that each group fits `budget` together: each format's engines and its llama.cpp peer
    stay in one group where they fit (the ratio to the peer is then measured side by side), formats in the order
    given. An engine that alone exceeds the budget gets a group of its own (and may not fit at all)."""
    by_fmt: dict[str, list[Spec]] = {}
    for spec in specs:
        by_fmt.setdefault(spec.fmt, []).append(spec)
    groups: list[list[Spec]] = []
    current: list[Spec] = []
    for members in by_fmt.values():
        for spec in members:
            if current and sum(s.nbytes for s in current) + spec.nbytes > budget:
                groups.append(current)
                current = []
            current.append(spec)
    return groups + ([current] if current else [])


def start(specs: list[Spec], threads: int) -> Engines:
    engines: Engines = {}
    for spec in specs:
        try:
            engines[spec.label] = (spec.fmt, Remote(spec.kind, *spec.args, env=spec.env))
        except Exception as e:  # noqa: BLE001 - an engine that cannot run is reported, not fatal
            print(f"{spec.label}: not measured ({e})")
            continue
        engines[spec.label][1].threads = threads
    return engines


def our_specs(path: Path, args: argparse.Namespace) -> list[Spec]:
    """One moepager engine per kernel, format, dense format and packing asked for, and with --compiled a compiled
    twin of each (`--compile`: resident experts up to 1 MiB inside the graph, any other ones and prepacked
    projections through its exits, models/graph_exit.py)."""
    specs = []
    for tier in args.tiers:
        for fmt in args.formats:
            for k in args.kernels:
                if not runs(k, fmt):
                    continue
                for dense in [None, *args.dense]:
                    for pack in ([True, False] if args.unpacked and not dense else [True]):
                        label = tagged(f"moepager {k}" + ("" if fmt == "bf16" else f" {fmt}")
                                       + (f" +dense {dense}" if dense else "") + ("" if pack else " (torch ops)"), tier)
                        key = fmt + ("+dense" if dense and fmt == "int8" else "")
                        options = (path, k, None if fmt == "bf16" else fmt, dense, pack)
                        nbytes = footprint(path, key, "ours")
                        specs.append(Spec(label, key, "ours", options, nbytes, tier, tier_env(tier)))
                        if args.compiled:
                            specs.append(Spec(f"{label} compiled", key, "ours", (*options, True), nbytes, tier,
                                              tier_env(tier)))
    return specs


def weight_bytes(facts: dict[str, tuple[str, Facts]]) -> dict[str, int]:
    """Weight bytes per decode token by peer format (bf16-dense rows), and by label for rows with int8 dense."""
    nbytes = {fmt: f.bytes_per_token for label, (fmt, f) in facts.items() if not f.int8_dense}
    nbytes |= {label: f.bytes_per_token for label, (fmt, f) in facts.items() if f.int8_dense}
    return nbytes | {fmt: nbytes[label] for label, (fmt, _) in facts.items() if fmt == "int8+dense"}


def tok_per_s(engines: Engines, ids: list[int], args: argparse.Namespace) -> dict[str, float]:
    """Each engine's decode tok/s: the median per-token time over interleaved rounds, after a warm-up."""
    for _, engine in engines.values():
        engine.tpot(ids, 4)
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.rounds):
        for label, (_, engine) in engines.items():
            time.sleep(PAUSE_S)
            times[label] += engine.tpot(ids, args.decode)
    return {label: 1 / statistics.median(t) for label, t in times.items()}


def main() -> None:
    args = arguments()
    state = machine_state()
    budget = int(args.memory * 1e9) if args.memory else int(HEADROOM * psutil.virtual_memory().available)
    sites = dict(entry.split("=", 1) for entry in args.llama_cpp)
    installed = importlib.util.find_spec("llama_cpp") is not None

    def has_llama(tier: str | None) -> bool:  # a build given for the tier, or the installed one
        return (tier or "") in sites or installed
    if not installed and not sites:
        print("llama.cpp: not measured (llama-cpp-python is not installed: pip install -e \".[peers]\")")
    results, rows = [], []
    for name in args.models:
        path = model_path(name)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        ids = torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
        ours = our_specs(path, args)
        peer_formats = list(dict.fromkeys((spec.fmt, spec.tier) for spec in ours))
        for threads in args.threads:
            specs = ours + ([] if args.no_hf else [Spec("HF", "bf16", "hf", (path,), footprint(path, "bf16", "hf"))])
            specs += [Spec(tagged(PEER_LABELS[fmt], tier, True), fmt, "llama.cpp",
                           (path, GGUF_TYPES[fmt], threads, sites.get(tier or "")),
                           footprint(path, fmt, "llama.cpp"), tier) for fmt, tier in peer_formats if has_llama(tier)]
            tiers = {s.label: s.tier for s in specs}
            groups = in_turns(specs, budget)
            if len(groups) > 1:
                need = sum(s.nbytes for s in specs) / 1e9
                print(f"{name} at {threads} threads: {len(specs)} engines need ~{need:.1f} GB, {budget / 1e9:.1f} GB "
                      f"may be used: measured in {len(groups)} turns ("
                      + "; ".join(", ".join(s.label for s in g) for g in groups)
                      + "); ratios across turns are less exact than within one")
            tok_s: dict[str, float] = {}
            facts: dict[str, tuple[str, Facts]] = {}
            fmts: dict[str, str] = {}
            for group in groups:
                engines = start(group, threads)
                tok_s |= tok_per_s(engines, ids, args)
                for label, (fmt, engine) in engines.items():
                    fmts[label] = fmt
                    if engine.facts is not None:
                        facts[label] = (fmt, engine.facts)
                    engine.close()
            nbytes = weight_bytes(facts)
            r = {"model": name, "threads": threads, "bytes_per_token": nbytes, "tok_s": tok_s, "turns": len(groups),
                 "tiers": tiers, "llama_cpp_sites": sites,
                 "GBps": {label: v * nbytes.get(label, nbytes.get(fmts[label], 0)) / 1e9
                          for label, v in tok_s.items()}}
            results.append(r)
            for label, v in tok_s.items():
                peer = tagged(PEER_LABELS[fmts[label]], tiers[label], True)
                rows.append([name, threads, label, v, v / tok_s["HF"] if "HF" in tok_s else "-",
                             v / tok_s[peer] if peer in tok_s else "-", r["GBps"][label]])
    print_table(["model", "threads", "engine", "decode tok/s", "x HF", "x llama.cpp (same format)",
                 "GB/s of weights"], rows)
    out = write_json(args.out, {"machine": state, "decode_steps": args.decode, "rounds": args.rounds,
                                "formats": args.formats, "results": results})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
