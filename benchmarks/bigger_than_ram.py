"""A model bigger than the RAM it may use, on the CPU: moepager (experts read from disk with O_DIRECT, the RAM its
expert cache) against llama.cpp (the file mapped: the kernel's page cache is its cache) on one GGUF file.

The model: `make-model` of a real geometry written straight to GGUF (--preset, default deepseek-v2-lite at its full
27 layers, 31.4 GB in bf16; random weights route both engines the same way, since both compute their routing from the
same weights). llama.cpp runs the file; moepager runs it through `--model FILE.gguf`, whose conversion holds only the
dense tensors and reads every expert from the GGUF file in place (checkpoints/gguf_read.py), so both engines read the
same bytes from the same file.

Each engine runs in a process of its own inside a memory cgroup of --memory-limit (default 20 GiB: the model is then
1.5x the memory it may use; the machine's own RAM is 23.5 GiB, 1.24x): page cache counts against the limit there as
anonymous memory does, so llama.cpp's mapping cannot keep the model cached beyond it, and an engine that needs more is
killed inside its cgroup (reported as such) rather than taking the machine with it. Before each run the page cache of
every file involved is dropped (posix_fadvise DONTNEED) and the disk's read speed is measured as `moepager calibrate`
measures it (--disk-probe GiB of random experts, 4 reads at once, O_DIRECT: it drifts, 2x within minutes), so each run
is reported against the disk it had. Rounds alternate the engines (--rounds).

In each process: the engine is built (moepager: its automatic fit, or a fixed --budgets entry, either with a prefetch
predictor after a "+", e.g. auto+gate-lookahead: the next layer's experts read while this one computes; llama.cpp: each
--llama variant: mmap, its default; no-mmap, the weights read into its own memory; mlock, mapped and locked), warmed up
with one 64-token request, then a fresh --prompts request each (prefill tok/s = prompt / time to its first token) and a
16-token prompt decoding --decode tokens (decode tok/s over those steps). Bytes read from disk per phase come from
/proc/self/io (read_bytes: what reached the block device, O_DIRECT and page faults alike); peak RSS from getrusage and
the cgroup's peak usage (page cache included).

With --replay, moepager's decode also replays real routing: the DeepSeek-V2-Lite trace's requests on this geometry
(`--route-from`; deepseek-v2-lite only), its bytes from disk per decode token beside what the simulator's LRFU
predicts at the same cache size (engine and simulator should agree within 1.2x). Labelled as replayed: llama.cpp
cannot replay routing.

    python -m benchmarks run bigger_than_ram [--preset deepseek-v2-lite] [--memory-limit 20GiB]
        [--budgets auto 12GiB] [--llama mmap no-mmap] [--prompts 512 2048] [--decode 32] [--rounds 2]
        [--threads 2] [--replay] [--out bigger_than_ram]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS,
    SHARED,
    converted,
    cpu_model,
    git_commit,
    machine_state,
    need_traces,
    print_table,
    write_json,
)

GiB = 1 << 30
WARMUP_PROMPT, DECODE_PROMPT = 64, 16
LLAMA_VARIANTS = {"mmap": dict(use_mmap=True, use_mlock=False), "no-mmap": dict(use_mmap=False, use_mlock=False),
                  "mlock": dict(use_mmap=True, use_mlock=True)}
KILLED = -9


# ---- the files and the disk ---------------------------------------------------------------------------------------


def model_file(preset: str, arch: str | None, layers: int | None) -> Path:
    """The GGUF file of `preset` (made once, straight to GGUF: a checkpoint beside it would not fit the disk)."""
    from moepager.loading.synth import make_model

    path = RESULTS / "models" / f"{preset}{f'-{arch}' if arch else ''}{f'-L{layers}' if layers else ''}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"making {path} (once)", flush=True)
        make_model(path, preset, arch, layers=layers)
    return path


def drop_cache(paths: list[Path]) -> None:
    """Empty the page cache of every file (posix_fadvise DONTNEED)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_speed(converted: Path, nbytes: int) -> float:
    """The disk's read rate (bytes/s) as the expert store sees it: `moepager calibrate`'s own measurement
    (planning/calibrate.py `disk_rates`: random experts through the engine's reader, 4 reads at once, O_DIRECT) over
    about `nbytes` of experts."""
    from moepager.config import EngineConfig
    from moepager.loading.build import LoadOptions, open_checkpoint
    from moepager.planning.calibrate import disk_rates
    from moepager.types import ExpertKey

    opened = open_checkpoint(converted, LoadOptions.of(EngineConfig()))
    cfg, reader = opened.config, opened.reader
    rng = random.Random(0)
    count = max(2, nbytes // reader.shape.nbytes)
    keys = [ExpertKey(rng.choice(cfg.moe_layers), rng.randrange(cfg.num_experts)) for _ in range(count)]
    try:
        return disk_rates(reader, keys, io_threads=4)[0]
    finally:
        reader.files.close()


# ---- memory cgroups ---------------------------------------------------------------------------------------------


class Cgroup:
    """A child memory cgroup of this process's own (v2: memory.max; v1: memory.limit_in_bytes), one per run."""

    def __init__(self, limit: int, name: str):
        self.limit = limit
        v2, v1 = None, None
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            ident, controllers, path = line.split(":", 2)
            if ident == "0" and not controllers:
                v2 = Path("/sys/fs/cgroup") / path.lstrip("/")
            elif "memory" in controllers.split(","):
                v1 = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
        base = v1 if v1 is not None and v1.is_dir() else v2
        if base is None:
            raise SystemExit("--memory-limit needs a memory cgroup (v1 or v2); run with --memory-limit none")
        self.v1 = base == v1
        self.path = base / name
        try:
            self.path.mkdir(exist_ok=True)
            (self.path / ("memory.limit_in_bytes" if self.v1 else "memory.max")).write_text(str(limit))
            if self.v1 and (self.path / "memory.memsw.limit_in_bytes").exists():
                try:
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit))
                except OSError:
                    pass
        except OSError as e:
            raise SystemExit(f"cannot make a memory cgroup at {self.path} ({e.strerror}); run with --memory-limit "
                             "none, or as a user who may") from None

    def peak(self) -> int | None:
        f = self.path / ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")
        try:
            return int(f.read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """OOM kills inside the cgroup (v1: memory.oom_control's oom_kill, v2: memory.events')."""
        try:
            text = (self.path / ("memory.oom_control" if self.v1 else "memory.events")).read_text()
            return int(dict(line.split()[:2] for line in text.splitlines() if line.strip()).get("oom_kill", 0))
        except (OSError, ValueError):
            return 0

    def join(self) -> None:
        """Move the calling process into the cgroup (a child's, between fork and exec: every page it touches from its
        first one is charged here; cgroup v1 does not move the charges of pages touched before)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


# ---- one engine in its own process ------------------------------------------------------------------------------


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def prompt_ids(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, vocab) for _ in range(n)]


class OursEngine:
    def __init__(self, path: Path, budget: str, threads: int):
        from moepager.config import EngineConfig, PrefetchConfig, StoreConfig
        from moepager.runtime.llm import LLM

        budget, _, predictor = budget.partition("+")
        store = StoreConfig() if budget == "auto" else StoreConfig(expert_memory=budget)
        self.llm = LLM(config=EngineConfig(model=str(path), threads=threads, store=store,
                                           prefetch=PrefetchConfig(predictor=predictor or None)), show_progress=False)
        self.vocab = self.llm.loaded.config.vocab_size
        self.note = self.llm.loaded.execution

    def prefill(self, ids: list[int]) -> float:
        from moepager.runtime.sampling import SamplingParams

        self.llm.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
        return self.llm.last_stats.ttft_s

    def decode(self, ids: list[int], steps: int) -> tuple[list[float], float]:
        """Per-step times, and bytes read from disk per decode step (the store's decode phase: its prompt's
        prefill pass not counted)."""
        from moepager.runtime.sampling import SamplingParams

        self.llm.generate([ids], SamplingParams(max_tokens=steps + 1, ignore_eos=True))
        decode = self.llm.last_stats.sections["experts"].to_dict().get("decode", {})
        return list(self.llm.last_stats.tpot_s), decode.get("bytes_disk_per_token", 0.0)

    def facts(self) -> dict[str, Any]:
        experts = self.llm.last_stats.sections["experts"].to_dict()
        return {"fit": self.note, "slots": experts.get("config", {}).get("device slots"),
                "decode_hit_rate": experts.get("decode", {}).get("hit_rate"),
                "expert_bytes": self.llm.loaded.expert_shape.nbytes,
                "moe_layers": len(self.llm.loaded.config.moe_layers)}

    def replay(self, trace: Path, requests: list[int], prompt: int, steps: int) -> dict[str, Any]:
        from moepager.runtime.replay import ReplaySpec

        self.llm.replay(ReplaySpec(trace, requests, prompt, "match", steps))
        s = self.llm.last_stats
        decode = s.sections["experts"].to_dict().get("decode", {})
        decoded = s.generated_tokens - s.num_prompts
        return {"decode_tok_s": decoded / s.decode_s, "disk_bytes_per_token": decode.get("bytes_disk_per_token", 0),
                "hit_rate": decode.get("hit_rate"), "decoded": decoded}


class LlamaEngine:
    def __init__(self, path: Path, variant: str, threads: int, ctx: int, site: str | None):
        if site:
            sys.path.insert(0, site)
        import llama_cpp

        self.model = llama_cpp.Llama(str(path), n_ctx=ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                                     n_ubatch=512, verbose=False, **LLAMA_VARIANTS[variant])
        self.vocab = self.model.n_vocab()
        self.note = ""

    def prefill(self, ids: list[int]) -> float:
        self.model.reset()
        start = time.perf_counter()
        self.model.eval(ids)
        return time.perf_counter() - start

    def decode(self, ids: list[int], steps: int) -> tuple[list[float], float]:
        """Per-step times, and bytes read from disk per step (after the prompt's pass: /proc/self/io)."""
        self.model.reset()
        self.model.eval(ids)
        times, before = [], read_bytes()
        for _ in range(steps):
            start = time.perf_counter()
            token = int(self.model.scores[self.model.n_tokens - 1].argmax())
            self.model.eval([token])
            times.append(time.perf_counter() - start)
        return times, (read_bytes() - before) / steps

    def facts(self) -> dict[str, Any]:
        return {}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One run, in this process (already in its cgroup: `run_child`): build, warm up, prefill each prompt, decode;
    figures and disk bytes per phase."""
    out: dict[str, Any] = {}
    t0, b0 = time.perf_counter(), read_bytes()
    if spec["engine"] == "moepager":
        engine: Any = OursEngine(Path(spec["path"]), spec["variant"], spec["threads"])
    else:
        engine = LlamaEngine(Path(spec["path"]), spec["variant"], spec["threads"], max(spec["prompts"]) + 256,
                             spec.get("site"))
    if spec.get("replay"):  # a run of its own: the cache as the load left it, as the simulator's warm start has it
        r, b = spec["replay"], read_bytes()
        out["replay"] = engine.replay(Path(r["trace"]), r["requests"], r["prompt"], r["steps"])
        out["replay"]["proc_disk_bytes_per_token"] = (read_bytes() - b) / max(out["replay"]["decoded"], 1)
        return out | engine.facts()
    engine.prefill(prompt_ids(engine.vocab, WARMUP_PROMPT, 1))
    out["load_and_warmup_s"] = time.perf_counter() - t0
    out["load_and_warmup_disk_GB"] = (read_bytes() - b0) / 1e9
    for i, n in enumerate(spec["prompts"]):
        b = read_bytes()
        seconds = engine.prefill(prompt_ids(engine.vocab, n, 100 + i))
        out[f"prefill_{n}_tok_s"] = n / seconds
        out[f"prefill_{n}_disk_GB"] = (read_bytes() - b) / 1e9
    b = read_bytes()
    times, per_step = engine.decode(prompt_ids(engine.vocab, DECODE_PROMPT, 7), spec["decode"])
    out["decode_tok_s"] = len(times) / sum(times)
    out["decode_tpot_median_ms"] = 1e3 * statistics.median(times)
    out["decode_disk_MB_per_token"] = per_step / 1e6
    out["decode_disk_GBps"] = per_step * out["decode_tok_s"] / 1e9
    out["decode_request_disk_GB"] = (read_bytes() - b) / 1e9  # its prompt's pass too
    out |= engine.facts()
    out["peak_rss_GiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    return out


def run_child(spec: dict[str, Any], cgroup: Cgroup | None, timeout: float) -> dict[str, Any]:
    # the child joins its cgroup before it execs Python: the interpreter's and torch's pages are charged there too, so
    # what the fit reads as the cgroup's usage is all the process holds (joining after the imports, a run's peak RSS
    # held 0.35 GiB the fit did not see)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bigger_than_ram", "--child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=cgroup.join if cgroup is not None else None)
    result: dict[str, Any] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line.removeprefix("RESULT "))
    if proc.returncode != 0 or not result:
        killed = proc.returncode == KILLED or (cgroup is not None and cgroup.oom_kills() > 0)
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
        result = {"failed": "killed: out of memory in its cgroup" if killed else f"exit {proc.returncode}: {tail}"}
    if cgroup is not None:
        result["cgroup_peak_GiB"] = (cgroup.peak() or 0) / GiB
    return result


# ---- the parent -------------------------------------------------------------------------------------------------


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="deepseek-v2-lite")
    p.add_argument("--arch", help="the architecture of --preset tiny (a smoke run)")
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's all)")
    p.add_argument("--memory-limit", default="20GiB", help="each engine's memory cgroup limit, or none")
    p.add_argument("--budgets", nargs="*", default=["auto", "12GiB"],
                   help="moepager's expert memory: auto (its fit) or a size, each with +PREDICTOR for prefetch")
    p.add_argument("--llama", nargs="*", default=["mmap", "no-mmap"], choices=list(LLAMA_VARIANTS))
    p.add_argument("--llama-site", help="a folder holding llama-cpp-python (pip install --target), searched first")
    p.add_argument("--prompts", nargs="+", type=int, default=[512, 2048])
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--disk-probe", type=float, default=1.0, help="GiB read to measure the disk before each run")
    p.add_argument("--replay", action="store_true", help="moepager also replays the DeepSeek-V2-Lite trace's routing")
    p.add_argument("--replay-requests", type=int, default=4)
    p.add_argument("--timeout", type=float, default=1800, help="seconds one engine's run may take")
    p.add_argument("--out", default="bigger_than_ram")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args()


def parse_size(text: str) -> int | None:
    if text.lower() == "none":
        return None
    from moepager.store.budget import Budget

    size = Budget.parse(text, "--memory-limit").nbytes
    if size is None:
        raise SystemExit("--memory-limit must be a size (20GiB) or none")
    return size


def replay_spec(args: argparse.Namespace) -> dict[str, Any] | None:
    """The trace's requests to replay (long enough for a 16-token prompt and --decode steps; from its end)."""
    if not args.replay:
        return None
    if args.preset != "deepseek-v2-lite" or args.layers or args.arch:
        raise SystemExit("--replay replays the DeepSeek-V2-Lite trace: it needs --preset deepseek-v2-lite, all layers")
    from benchmarks.offload_replay import replayed_requests

    need_traces("deepseek-v2-lite")
    trace = converted("deepseek-csv", SHARED / "deepseek-v2-lite", "deepseek-v2-lite")  # once, as other benchmarks do
    requests = replayed_requests(trace, 200, args.replay_requests, DECODE_PROMPT + args.decode)
    return {"trace": str(trace), "requests": requests, "prompt": DECODE_PROMPT, "steps": args.decode}


def simulated_bytes(replay: dict[str, Any], slots: int, expert_bytes: int, layers: int) -> float:
    """The simulator's LRFU bytes from disk per decode token at `slots` cached experts (evenly per layer, warm), on
    the replayed requests cut as the engine replays them."""
    from moepager.trace.format import DECODE
    from moepager.trace.simulate import SimSpec, simulate
    from moepager.trace.workload import Cut, load_workload

    work = load_workload(replay["trace"], requests=replay["requests"],
                         cut=Cut(prompt_tokens=replay["prompt"], decode_steps=replay["steps"]))
    sim = simulate(work, SimSpec("lrfu", slots // layers, warm=True))
    rows = sim.step_phase == DECODE
    return float(sim.demand_loads_SL[rows].sum()) * expert_bytes / max(int(sim.step_tokens[rows].sum()), 1)


def main() -> None:
    args = arguments()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return
    import importlib.util

    from moepager.checkpoints.gguf_read import resolve_model_path
    from moepager.models.registry import tensor_specs

    path = model_file(args.preset, args.arch, args.layers)
    converted = resolve_model_path(path, tensor_specs)  # once, here: the dense tensors' conversion is not a run's work
    files = [path, *sorted(converted.glob("*.safetensors"))]
    limit = parse_size(args.memory_limit)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    have_llama = args.llama_site is not None or importlib.util.find_spec("llama_cpp") is not None
    if args.llama and not have_llama:
        print('llama.cpp rows skipped: llama-cpp-python is not installed (pip install -e ".[peers]", or --llama-site)')
    runs = [("moepager", b) for b in args.budgets] + [("llama.cpp", v) for v in (args.llama if have_llama else [])]
    replay = replay_spec(args)
    if replay is not None:
        # not with a predictor: one reading random weights' gates forecasts their routing, not the replayed one
        runs += [("moepager-replay", b) for b in args.budgets if "+" not in b]
    state = machine_state()
    size = path.stat().st_size
    print(f"{path.name}: {size / 1e9:.1f} GB, {size / ram:.2f}x this machine's {ram / GiB:.1f} GiB RAM"
          + (f", {size / limit:.2f}x the {limit / GiB:.0f} GiB memory cgroup each engine runs in" if limit else ""))
    results: dict[str, list[dict[str, Any]]] = {f"{e} {v}": [] for e, v in runs}
    for rnd in range(args.rounds):
        for engine, variant in runs if rnd % 2 == 0 else runs[::-1]:
            drop_cache(files)
            disk = disk_speed(converted, int(args.disk_probe * GiB))
            drop_cache(files)
            cgroup = Cgroup(limit, f"moepager-bench-{os.getpid()}-{len(sum(results.values(), []))}") if limit else None
            spec = {"engine": engine.removesuffix("-replay"), "variant": variant, "path": str(path),
                    "threads": args.threads, "prompts": args.prompts, "decode": args.decode, "site": args.llama_site,
                    "replay": replay if engine.endswith("-replay") else None}
            try:
                got = run_child(spec, cgroup, args.timeout)
            finally:
                if cgroup is not None:
                    cgroup.remove()
            got["disk_GBps_before"] = disk / 1e9
            results[f"{engine} {variant}"].append(got)
            print(f"round {rnd + 1} {engine} {variant}: {said(got, args.prompts)}", flush=True)
    rows = summarize(results, args)
    for row in rows:
        if row["engine"] == "moepager-replay" and "failed" not in row:
            first = results[f"moepager-replay {row['variant']}"][0]
            sim = simulated_bytes(replay, first["slots"], first["expert_bytes"], first["moe_layers"])
            row["sim_lrfu_disk_MB_per_token"] = sim / 1e6
            row["engine_over_sim"] = row["replay_disk_MB_per_token"] / row["sim_lrfu_disk_MB_per_token"]
    show(rows, args, replay is not None)
    out = write_json(args.out, {"model": path.name, "model_bytes": size, "ram_bytes": ram, "memory_limit": limit,
                                "cpu": cpu_model(), "commit": git_commit(), "machine": state,
                                "args": vars(args), "rows": rows, "runs": results})
    print(f"results: {out}")


def said(got: dict[str, Any], prompts: list[int]) -> str:
    """One run in a line."""
    if "failed" in got:
        return got["failed"]
    if "replay" in got:
        r = got["replay"]
        return f"replayed decode {r['decode_tok_s']:.2f} tok/s, {r['disk_bytes_per_token'] / 1e6:.0f} MB/token"
    prefill = ", ".join(f"{n}: {got[f'prefill_{n}_tok_s']:.1f}" for n in prompts)
    return (f"decode {got['decode_tok_s']:.2f} tok/s, prefill {prefill} tok/s, peak RSS {got['peak_rss_GiB']:.1f} GiB, "
            f"disk {got['disk_GBps_before']:.2f} GB/s")


def summarize(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each engine's median over its rounds, the ratios to llama.cpp mmap's, and each against the disk it had."""
    rows = []
    keys = ["decode_tok_s", "decode_disk_MB_per_token", "decode_disk_GBps", "peak_rss_GiB", "cgroup_peak_GiB",
            "disk_GBps_before", "load_and_warmup_s", *(f"prefill_{n}_tok_s" for n in args.prompts)]
    for name, runs in results.items():
        engine, variant = name.split(" ", 1)
        ok = [r for r in runs if "failed" not in r]
        row: dict[str, Any] = {"engine": engine, "variant": variant, "rounds": len(ok)}
        if not ok:
            row["failed"] = runs[0].get("failed") if runs else "not run"
            row["cgroup_peak_GiB"] = max((r.get("cgroup_peak_GiB") or 0) for r in runs) if runs else None
            rows.append(row)
            continue
        row["fit"], row["slots"] = ok[0].get("fit"), ok[0].get("slots")
        if engine == "moepager-replay":
            row["replay_decode_tok_s"] = statistics.median(r["replay"]["decode_tok_s"] for r in ok)
            row["replay_disk_MB_per_token"] = statistics.median(r["replay"]["disk_bytes_per_token"] for r in ok) / 1e6
            row["replay_proc_disk_MB_per_token"] = statistics.median(r["replay"]["proc_disk_bytes_per_token"]
                                                                     for r in ok) / 1e6
            row["replay_hit_rate"] = statistics.median(r["replay"]["hit_rate"] or 0 for r in ok)
            row["disk_GBps_before"] = statistics.median(r["disk_GBps_before"] for r in ok)
            rows.append(row)
            continue
        for k in keys:
            vals = [r[k] for r in ok if r.get(k) is not None]
            row[k] = statistics.median(vals) if vals else None
        row["decode_per_disk_GBps"] = row["decode_tok_s"] / row["disk_GBps_before"]
        rows.append(row)
    base = next((r for r in rows if r["engine"] == "llama.cpp" and r["variant"] == "mmap" and "failed" not in r), None)
    for r in rows:
        if base is not None and "failed" not in r and r["engine"] != "moepager-replay":
            r["decode_x_llama"] = r["decode_tok_s"] / base["decode_tok_s"]
            r["decode_per_disk_x_llama"] = r["decode_per_disk_GBps"] / base["decode_per_disk_GBps"]
            for n in args.prompts:
                r[f"prefill_{n}_x_llama"] = r[f"prefill_{n}_tok_s"] / base[f"prefill_{n}_tok_s"]
    return rows


def show(rows: list[dict[str, Any]], args: argparse.Namespace, replay: bool) -> None:
    def f(v: Any, fmt: str = ".2f") -> str:
        return "-" if v is None else format(v, fmt)

    headers = ["engine", "memory", "decode tok/s", "x llama", "x llama / disk", "MB/token", "read GB/s",
               *(f"prefill {n}" for n in args.prompts), *(f"x llama {n}" for n in args.prompts),
               "peak RSS GiB", "cgroup peak", "disk GB/s"]
    table = []
    for r in rows:
        if r["engine"] == "moepager-replay":
            continue
        if "failed" in r:
            table.append([r["engine"], r["variant"], "failed", *["-"] * (len(headers) - 3)])
            continue
        table.append([r["engine"], r["variant"], f(r["decode_tok_s"]), f(r.get("decode_x_llama")),
                      f(r.get("decode_per_disk_x_llama")), f(r["decode_disk_MB_per_token"], ".0f"),
                      f(r["decode_disk_GBps"]),
                      *(f(r[f"prefill_{n}_tok_s"], ".1f") for n in args.prompts),
                      *(f(r.get(f"prefill_{n}_x_llama")) for n in args.prompts),
                      f(r["peak_rss_GiB"], ".1f"), f(r["cgroup_peak_GiB"], ".1f"), f(r["disk_GBps_before"])])
    print_table(headers, table)
    for r in rows:
        if "failed" in r:
            print(f"{r['engine']} {r['variant']}: {r['failed']}")
        elif r.get("fit"):
            print(f"moepager {r['variant']}: {r['fit']}")
    if replay:
        print("\nmoepager on replayed real routing (DeepSeek-V2-Lite trace, --route-from; llama.cpp cannot replay):")
        print_table(["memory", "decode tok/s", "hit %", "store MB/token", "read_bytes MB/token (prompts too)",
                     "simulator LRFU MB/token", "engine / simulator", "disk GB/s"],
                    [[r["variant"], f(r.get("replay_decode_tok_s")), f(100 * (r.get("replay_hit_rate") or 0), ".1f"),
                      f(r.get("replay_disk_MB_per_token"), ".0f"), f(r.get("replay_proc_disk_MB_per_token"), ".0f"),
                      f(r.get("sim_lrfu_disk_MB_per_token"), ".0f"), f(r.get("engine_over_sim")),
                      f(r.get("disk_GBps_before"))]
                     for r in rows if r["engine"] == "moepager-replay" and "failed" not in r])


if __name__ == "__main__":
    main()
