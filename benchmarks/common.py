"""Shared helpers for benchmark scripts: idle check, model creation cache, result writing, tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from moepager.accel import cpu_tiers

RESULTS = Path(__file__).resolve().parent / "results"
SCHEMA = 1
"""Version of the JSON every benchmark writes (`write_json`): {schema, benchmark, git, machine, args, results}."""
TRACES_ENV = "MOEPAGER_TRACES"
"""The real routing traces' root (`python -m benchmarks --traces DIR` sets it); default ../shared/traces beside the
repository."""
SHARED = Path(os.environ.get(TRACES_ENV) or Path(__file__).resolve().parents[2] / "shared" / "traces")


def machine_state() -> dict[str, Any]:
    """Record how busy the machine is before measuring (other work ruins 2-thread timings)."""
    busy = psutil.cpu_percent(interval=1.0)
    if busy > 20:
        print(f"warning: machine is {busy:.0f}% busy before the benchmark; timings will be noisy")
    return {"cpu_busy_percent_before": busy, "cpus": psutil.cpu_count(), "platform": platform.platform(),
            "cpu": cpu_model(), "cpu_tiers": cpu_tiers.runnable(), "torch": torch.__version__,
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def cpu_model() -> str:
    """This CPU's model name as /proc/cpuinfo gives it (x86's `model name`, with family and model; ARM's `CPU part`)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break
    except OSError:
        return platform.processor() or "unknown"
    if "model name" in fields:
        return f"{fields['model name']} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"
    return f"{platform.machine()} CPU part {fields.get('CPU part', '?')}"


def ensure_model(name: str, preset: str, layers: int | None, dtype: str = "bfloat16") -> Path:
    from moepager.loading.synth import make_model

    path = RESULTS / "models" / name
    if not (path / "config.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        make_model(path, preset, layers=layers, dtype=dtype, force=True)
    return path


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def git_commit() -> str:
    """The checkout's commit (with "-dirty" when it has changes), or "unknown" outside a git checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def write_json(name: str, data: dict[str, Any]) -> Path:
    """Write results/NAME.json in the one schema: the benchmark's own `data` under "results", beside the schema
    version, the benchmark's name, the commit, the date and the machine (written through a temporary name)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    record = {"schema": SCHEMA, "benchmark": name, "git": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": {"platform": platform.platform(), "cpus": psutil.cpu_count(), "torch": torch.__version__,
                          "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
              "args": sys.argv[1:], "results": data}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


def need_traces(*names: str) -> None:
    """Exit with the reason (status 3: skipped) when a trace this benchmark reads is missing."""
    missing = [name for name in names if not (SHARED / name).exists()]
    if missing:
        print(f"skipped: traces {', '.join(missing)} not found under {SHARED} (set --traces or {TRACES_ENV})",
              file=sys.stderr)
        raise SystemExit(3)


def converted(fmt: str, src: Path, name: str, opts: Any = None) -> Path:
    """A public trace converted to moepager's format once, cached under results/traces/."""
    from moepager.trace.convert import ConvertOptions, convert

    out = RESULTS / "traces" / f"{name}.mpt"
    if not out.exists():
        print(f"converting {src} -> {out}")
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(fmt, src, out, opts or ConvertOptions())
    return out


def demo_documents() -> tuple[list[str], list[str]]:
    """The built-in demo model's (train, validation) documents, split as scripts/train_demo_model.py splits them."""
    from scripts.train_demo_model import split_documents

    return split_documents(SHARED / "olmoe-stats" / "text")


def record_demo_trace(path: Path, docs: list[str], tokens: int, hidden: bool = False, max_new: int = 1,
                      model: Path | None = None) -> Path:
    """A model's routing (default: the built-in demo model) over the first `tokens` tokens of each document (one
    static batch, prefill), written by the engine's recorder; cached by path."""
    from moepager.runtime.llm import LLM
    from moepager.runtime.sampling import SamplingParams

    if path.exists():
        return path
    llm = LLM(model, show_progress=False)
    prompts = [ids[:tokens] for ids in (llm.encode(doc) for doc in docs) if len(ids) >= 2]
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"recording {len(prompts)} documents ({sum(map(len, prompts))} tokens) -> {path}")
    llm.generate(prompts, SamplingParams(max_tokens=max_new), record_trace=path, record_hidden=hidden)
    return path


def bytes_per_decode_token(llm: Any) -> int:
    """Weight bytes one decode token reads: every non-expert weight (the embedding table only when it is also
    the LM head: tied, and not given an int8 or prepacked head of its own) plus top-k experts per MoE layer."""
    from moepager.accel.dense_quant import Int8A8Linear
    from moepager.accel.packed import PackedLinear

    cfg, loaded = llm.loaded.config, llm.loaded
    non_expert = sum(t.numel() * t.element_size() for n, t in loaded.model.state_dict().items()
                     if n != "model.embed_tokens.weight" or loaded.model.lm_head is None)
    for m in loaded.model.modules():  # prepacked weights are not in the state dict
        if isinstance(m, PackedLinear):
            non_expert += m.in_features * m.out_features * 2  # bf16
        elif isinstance(m, Int8A8Linear):
            non_expert += m.in_features * m.out_features + m.out_features * 4  # int8, float scales
    return non_expert + cfg.num_moe_layers * cfg.top_k * loaded.expert_shape.nbytes


def measured_workloads(args: Any, replayed: Any, built_in: Any) -> tuple[dict[str, Any], list[dict]]:
    """A benchmark's measured part: its thread count set (`args.threads`), the machine's state before, then the rows
    of `replayed(args)` (when `args.workloads` has "replay" and the DeepSeek-V2-Lite trace is there) and of
    `built_in(args)` (when it has "built-in")."""
    if args.threads:
        torch.set_num_threads(args.threads)
    state = machine_state()
    rows: list[dict] = []
    if "replay" in args.workloads and (SHARED / "deepseek-v2-lite").exists():
        rows += replayed(args)
    if "built-in" in args.workloads:
        rows += built_in(args)
    return state, rows
