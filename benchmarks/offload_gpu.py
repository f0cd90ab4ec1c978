"""GPU: all-resident vs experts streamed from pinned host RAM at 50% and 25% device budgets, side by side.

Model: `make-model --preset qwen3-30b-a3b --layers N` (real geometry: 128 experts of 9 MiB, top-8) in bf16.
All configurations are loaded once and measured in turn, --reps rounds of one greedy generate each. In the
same run, a pinned host->device `copy_` of 1 GiB measures the link's peak. Reported: decode tokens/s, the
host->device bytes per token, and the H2D rate the decode loop sustained (bytes moved / decode time, a lower
bound of the link rate while copying) against that peak. Only runs where CUDA is available.

    python benchmarks/offload_gpu.py [--layers 8] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ensure_model, machine_state, print_table, write_json  # noqa: E402

from moepager.config import StoreConfig  # noqa: E402
from moepager.runtime.llm import LLM  # noqa: E402
from moepager.runtime.sampling import SamplingParams  # noqa: E402


def pinned_copy_peak(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--budgets", nargs="+", default=["50%", "25%"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("offload_gpu.py needs CUDA")
    state = machine_state() | {"gpu": torch.cuda.get_device_name()}
    path = ensure_model(f"qwen3-30b-a3b-L{args.layers}", "qwen3-30b-a3b", args.layers)
    configs = {"resident": None} | {b: StoreConfig(expert_memory=b) for b in args.budgets}
    llms = {n: LLM(path, device="cuda", store=c, show_progress=False) for n, c in tqdm(configs.items(), "loading")}
    peak = pinned_copy_peak()
    gen = torch.Generator().manual_seed(0)
    vocab = llms["resident"].loaded.config.vocab_size
    runs: dict[str, list[dict]] = {n: [] for n in configs}
    for _ in tqdm(range(args.reps), "rounds"):
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
        for name, llm in llms.items():
            llm.generate([prompt], SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True))
            s = llm.last_stats
            decode = s.sections["experts"].to_dict().get("decode", {})
            h2d = decode.get("bytes_host_to_device", 0)
            runs[name].append({"decode_tok_s": s.decode_tokens_per_s, "hit_rate": decode.get("hit_rate", 1.0),
                               "h2d_bytes_per_token": decode.get("bytes_host_to_device_per_token", 0.0),
                               "h2d_GBps_sustained": h2d / s.decode_s / 1e9 if s.decode_s else 0.0})
    base = statistics.median(r["decode_tok_s"] for r in runs["resident"])
    results, rows = [], []
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]} | {"config": name}
        med["vs_resident"] = med["decode_tok_s"] / base
        med["h2d_vs_peak"] = med["h2d_GBps_sustained"] * 1e9 / peak
        results.append(med)
        rows.append([name, med["decode_tok_s"], med["vs_resident"], 100 * med["hit_rate"],
                     med["h2d_bytes_per_token"] / 2**20, med["h2d_GBps_sustained"], med["h2d_vs_peak"]])
    print_table(["config", "decode tok/s", "vs resident", "hit %", "H2D MiB/token", "H2D GB/s sustained",
                 "vs peak"], rows)
    print(f"pinned copy_ peak: {peak / 1e9:.1f} GB/s")
    out = write_json("offload_gpu", {"machine": state, "model": str(path), "args": vars(args),
                                     "pinned_copy_peak_GBps": peak / 1e9, "results": results, "runs": runs})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
