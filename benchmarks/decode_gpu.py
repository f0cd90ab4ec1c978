"""GPU decode, every expert resident: moepager against HF transformers on the same checkpoint, at fresh and warm KV
lengths, against the bandwidth limit, and with int8 / int4 experts.

Model: `make-model --preset qwen3-30b-a3b --layers 8` in bf16 (128 experts of 9 MiB, top-8; issue 15's GPU
geometry). Each engine decodes --decode tokens after a --prompt-token prompt twice: the first run meets every KV
length for the first time (fresh: a backend that plans per shape pays here), the second the same lengths again
(warm); then the same twice after a prompt --long tokens long (fresh and warm at longer lengths: the 2026-11-26
H200 run measured only the fresh one). HF transformers runs a greedy loop
over its DynamicCache on the device (no host sync per token, timed between two synchronizations: generous to
it); moepager runs its real generate path (sampling included). The bandwidth limit is the active weight bytes of
a decode token against the device's copy bandwidth counted as bytes read plus bytes written (a 512 MiB
device-to-device copy), as issue 15 counts it. Kernels run and launch calls made per moepager decode token come
from the profiler (a replayed CUDA graph runs its kernels from one launch call).

    python benchmarks/decode_gpu.py [--layers 8] [--decode 64] [--experts bf16 bf16-eager int8 ... int4-eager]
Prints a table and writes results/decode_gpu.json and .png.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, bytes_per_decode_token, ensure_model, machine_state, print_table, write_json
from benchmarks.decode_cpu import hf_decode, ours_decode
from moepager.config import EngineConfig, ExpertFormat
from moepager.planning.calibrate import copy_rate
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams


def prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def fresh_and_warm(run, texts: list[list[int]], steps: int) -> dict[str, float]:
    """texts: [warm-up, short, long]. Decode tokens/s after the short prompt at fresh then warm (the same lengths
    again) KV lengths, and the same after the long one."""
    run(texts[0], 4)
    fresh = run(texts[1], steps)
    warm = run(texts[1], steps)
    long = run(texts[2], steps)
    warm_long = run(texts[2], steps)
    return {"fresh_tok_s": fresh, "warm_tok_s": warm, "fresh_long_tok_s": long, "warm_long_tok_s": warm_long,
            "fresh_vs_warm": fresh / warm, "fresh_long_vs_warm": long / warm_long}


def launches_per_token(llm: LLM, prompt: list[int], steps: int = 8) -> tuple[float, float]:
    """(kernels run, launch calls the host made) per decode token, from the profiler: a (steps + 1)-token
    generation less a 1-token one, over `steps`. A replayed CUDA graph runs its kernels from one launch call."""
    from torch.profiler import ProfilerActivity, profile

    def counts(tokens: int) -> tuple[int, int]:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))
        events = prof.key_averages()
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        calls = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel",
                                                                  "cudaGraphLaunch", "cudaLaunchCooperative")))
        return kernels, calls
    (k1, c1), (kn, cn) = counts(1), counts(steps + 1)
    return (kn - k1) / steps, (cn - c1) / steps


def moepager_row(path: Path, fmt: str, args: argparse.Namespace, texts: list[list[int]],
                 copy_Bps: float) -> dict[str, Any]:
    """`fmt`: bf16, int8 or int4, with CUDA graphs where they apply; with -eager, without."""
    t0 = time.perf_counter()
    experts = fmt.removesuffix("-eager")
    llm = LLM(show_progress=False, config=EngineConfig(
        model=str(path), device=args.device, experts=ExpertFormat(dtype=None if experts == "bf16" else experts),
        cuda_graphs=not fmt.endswith("-eager")))
    active = bytes_per_decode_token(llm)
    row = {"engine": "moepager", "experts": fmt, "active_MB": active / 1e6, "load_s": time.perf_counter() - t0,
           "limit_tok_s": copy_Bps / active}
    row |= fresh_and_warm(lambda p, n: ours_decode(llm, torch.tensor([p]), n), texts, args.decode)
    row["share_of_limit"] = row["warm_tok_s"] / row["limit_tok_s"]
    if args.device == "cuda":
        row["kernels_per_token"], row["launch_calls_per_token"] = launches_per_token(llm, texts[1])
    graphs = llm.engine.runner.graphs
    row["cuda_graphs"] = graphs is not None and graphs.enabled and graphs.replays > 0
    row["peak_GB"] = (llm.last_stats.peak_cuda_bytes or 0) / 1e9
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--long", type=int, default=1000)
    formats = ["bf16", "bf16-eager", "int8", "int8-eager", "int4", "int4-eager"]
    ap.add_argument("--experts", nargs="+", default=formats, choices=formats, help="*-eager: CUDA graphs off")
    ap.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    ap.add_argument("--model", type=Path, help="another checkpoint (default: the qwen3 geometry, made once)")
    ap.add_argument("--out", default="decode_gpu", help="results name")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (tests)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("decode_gpu.py needs CUDA")
    device = torch.device(args.device)
    state = machine_state() | {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}
    path = args.model or ensure_model(f"qwen3-30b-a3b-L{args.layers}", "qwen3-30b-a3b", args.layers)
    print(f"model: {path}")
    copy_Bps = 2 * copy_rate(device)  # read + written, as issue 15 counts it
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    texts = prompts(vocab, (5, args.prompt, args.long))
    rows = []
    for fmt in args.experts:
        rows.append(moepager_row(path, fmt, args, texts, copy_Bps))
        gc.collect()  # the engine's weights go before the next one loads
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        place = {"device_map": args.device} if args.device != "cpu" else {}  # straight to the GPU (accelerate)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **place).eval()
        rows.append({"engine": "transformers", "experts": "bf16"}
                    | fresh_and_warm(lambda p, n: hf_decode(model, torch.tensor([p]), n), texts, args.decode))
        print(rows[-1], flush=True)
        base = rows[-1]["warm_tok_s"]
        for r in rows[:-1]:
            r["vs_hf"] = r["warm_tok_s"] / base
    report(rows, copy_Bps)
    given = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    out = write_json(args.out, {"machine": state, "model": str(path), "args": given,
                                    "copy_GBps_read_plus_written": copy_Bps / 1e9, "rows": rows})
    plot(rows, args.out)
    print(f"\nwrote {out}")


def report(rows: list[dict[str, Any]], copy_Bps: float) -> None:
    def f(r: dict[str, Any], key: str, fmt: str = "{:.1f}") -> str:
        return fmt.format(r[key]) if r.get(key) is not None else "-"
    print(f"\ndevice copy bandwidth (read + written): {copy_Bps / 1e9:.0f} GB/s")
    print_table(["engine", "experts", "fresh tok/s", "warm tok/s", "fresh/warm", "long: fresh", "warm", "fresh/warm",
                 "vs HF", "limit tok/s", "of limit", "kernels/tok", "launch calls/tok", "graphs"],
                [[r["engine"], r["experts"], f(r, "fresh_tok_s"), f(r, "warm_tok_s"), f(r, "fresh_vs_warm", "{:.2f}"),
                  f(r, "fresh_long_tok_s"), f(r, "warm_long_tok_s"), f(r, "fresh_long_vs_warm", "{:.2f}"),
                  f(r, "vs_hf", "{:.2f}x"),
                  f(r, "limit_tok_s", "{:.0f}"), f(r, "share_of_limit", "{:.1%}"), f(r, "kernels_per_token", "{:.0f}"),
                  f(r, "launch_calls_per_token", "{:.0f}"), r.get("cuda_graphs", "-")]
                 for r in rows])


def plot(rows: list[dict[str, Any]], name: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['engine']}\n{r['experts']}" for r in rows]
    xs = range(len(rows))
    for off, key, label in ((-0.27, "fresh_tok_s", "fresh lengths"), (0, "warm_tok_s", "warm"),
                            (0.27, "fresh_long_tok_s", "fresh, long prompt")):
        ax.bar([x + off for x in xs], [r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("decode tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)


if __name__ == "__main__":
    main()
