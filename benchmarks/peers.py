"""moepager against its peers on the CPU, all experts resident, bf16 or quantized experts: decode tokens/s side by side.

Engines, each in its own process and measured in interleaved rounds (median of per-token times over --decode steps
after a 16-token prompt; the warm-up decode compiles a --compiled row): moepager (one row per --kernels entry and
--formats entry: bf16, or --expert-dtype int8/int4), HF
transformers (a greedy loop over its DynamicCache; bf16) and llama.cpp through `llama-cpp-python` when it is
installed (`pip install -e ".[peers]"`, which builds llama.cpp from source; on this project's CPU set CMAKE_ARGS
as FACTS.md says, AMX off) on the same weights written by our own `moepager export-gguf`: BF16, or Q8_0/Q4_0
experts with every other tensor bf16 (what moepager's int8/int4 quantize); with --dense and int8 experts also
Q8_0 with the dense projections in Q8_0 too (`export-gguf --dense-type q8_0`: what --dense-dtype int8/int8-a8
quantize), the peer of the moepager rows with int8 experts and int8 dense projections. Our bf16 export is tensor for
tensor what llama.cpp's own convert_hf_to_gguf.py writes. Models: the built-in demo-moe and `make-model --preset
qwen3-30b-a3b --layers 4` (~1.08 GB of weights read per token in bf16). Reports tok/s, the ratios to HF and to
llama.cpp in the same format, and the weight bytes per token divided by the time per token (achieved GB/s).

    python benchmarks/peers.py [--models demo qwen3-30b-a3b] [--threads 1 2] [--rounds 3] [--decode 64]
        [--kernels auto loop gather grouped packed] [--formats bf16 int8 int4] [--dense int8 int8-a8]
        [--unpacked] [--compiled] [--no-hf]
        [--out peers]
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NamedTuple

import torch

from benchmarks.common import RESULTS, bytes_per_decode_token, ensure_model, machine_state, print_table, write_json
from moepager.checkpoints.default import default_model_path
from moepager.config import DENSE_DTYPES, EngineConfig
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams

PROMPT = 16
PAUSE_S = 0.5
"""Idle time before each engine's round: the OpenMP threads of the engine that ran before spin a while after its last
step before they sleep, and on two cores they would take the next engine's."""


class Ours:
    def __init__(self, path: Path, kernel: str, expert_dtype: str | None = None, dense_dtype: str | None = None,
                 pack_dense: bool = True, compile: bool = False):
        self.llm = LLM(config=EngineConfig(model=str(path), expert_kernel=kernel, expert_dtype=expert_dtype,
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
    def __init__(self, path: Path, gguf_types: tuple[str, str | None], threads: int):
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

    def __init__(self, kind: str, *args: object):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(kind, args, child), daemon=True)
        self.process.start()
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
                    help="also each bf16-dense moepager row with --no-packed-dense (torch's own GEMV for the large "
                         "dense projections instead of oneDNN on prepacked weights)")
    ap.add_argument("--compiled", action="store_true",
                    help="also each moepager row with --compile (the one-token decode step compiled by TorchInductor; "
                         "twice the engines in memory: on the qwen3 geometry ask for one row)")
    ap.add_argument("--no-hf", action="store_true", help="leave transformers out")
    ap.add_argument("--out", default="peers", help="results/NAME.json")
    return ap.parse_args()


Engines = dict[str, tuple[str, Remote]]
"""Row label -> (its peer format: bf16, int8, int4 or int8+dense; the engine)."""


def our_engines(path: Path, args: argparse.Namespace) -> Engines:
    """One moepager engine per kernel, format, dense format and packing asked for, and with --compiled a compiled
    twin of each (`--compile`: resident experts up to 1 MiB inside the graph, any other ones and prepacked
    projections through its exits, models/graph_exit.py)."""
    rows = {f"moepager {k}" + ("" if fmt == "bf16" else f" {fmt}") + (f" +dense {dense}" if dense else "")
            + ("" if pack else " (torch GEMV)"): (fmt + ("+dense" if dense and fmt == "int8" else ""),
                                                 (k, None if fmt == "bf16" else fmt, dense, pack))
            for fmt in args.formats for k in args.kernels if runs(k, fmt)
            for dense in [None, *args.dense]
            for pack in ([True, False] if args.unpacked and not dense else [True])}
    ours: Engines = {label: (key, Remote("ours", path, *options)) for label, (key, options) in rows.items()}
    if args.compiled:
        ours |= {f"{label} compiled": (key, Remote("ours", path, *options, True))
                 for label, (key, options) in rows.items()}
    return ours


def weight_bytes(ours: Engines) -> dict[str, int]:
    """Weight bytes per decode token by peer format (bf16-dense rows), and by label for rows with int8 dense."""
    facts = {label: engine.facts for label, (_, engine) in ours.items() if engine.facts is not None}
    nbytes = {ours[label][0]: f.bytes_per_token for label, f in facts.items() if not f.int8_dense}
    nbytes |= {label: f.bytes_per_token for label, f in facts.items() if f.int8_dense}
    return nbytes | {fmt: nbytes[label] for label, (fmt, _) in ours.items() if fmt == "int8+dense"}


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
    have_llama = importlib.util.find_spec("llama_cpp") is not None
    if not have_llama:
        print("llama.cpp: not measured (llama-cpp-python is not installed: pip install -e \".[peers]\")")
    results, rows = [], []
    for name in args.models:
        path = model_path(name)
        ours = our_engines(path, args)
        peers: Engines = {} if args.no_hf else {"HF": ("bf16", Remote("hf", path))}
        nbytes = weight_bytes(ours)
        peer_formats = [*args.formats] + (["int8+dense"] if "int8+dense" in nbytes else [])
        vocab = next(f.vocab for _, engine in ours.values() if (f := engine.facts) is not None)
        ids = torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
        for threads in args.threads:
            llama: Engines = {}
            if have_llama:
                for fmt in peer_formats:
                    try:
                        llama[PEER_LABELS[fmt]] = (fmt, Remote("llama.cpp", path, GGUF_TYPES[fmt], threads))
                    except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                        print(f"{PEER_LABELS[fmt]} on {name}: not measured ({e})")
            engines: Engines = {**ours, **peers, **llama}
            for _, engine in engines.values():
                engine.threads = threads
            tok_s = tok_per_s(engines, ids, args)
            for _, engine in llama.values():
                engine.close()
            fmts = {label: fmt for label, (fmt, _) in engines.items()}
            r = {"model": name, "threads": threads, "bytes_per_token": nbytes, "tok_s": tok_s,
                 "GBps": {label: v * nbytes.get(label, nbytes[fmts[label]]) / 1e9 for label, v in tok_s.items()}}
            results.append(r)
            for label, v in tok_s.items():
                peer = PEER_LABELS[fmts[label]]
                rows.append([name, threads, label, v, v / tok_s["HF"] if "HF" in tok_s else "-",
                             v / tok_s[peer] if peer in tok_s else "-", r["GBps"][label]])
        for _, engine in {**ours, **peers}.values():
            engine.close()
    print_table(["model", "threads", "engine", "decode tok/s", "x HF", "x llama.cpp (same format)",
                 "GB/s of weights"], rows)
    out = write_json(args.out, {"machine": state, "decode_steps": args.decode, "rounds": args.rounds,
                                "formats": args.formats, "results": results})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
