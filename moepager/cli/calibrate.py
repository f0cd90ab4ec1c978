"""`moepager calibrate`: measure this machine's cost-model constants for a model's geometry; write a profile."""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from moepager.atomic_io import check_file
from moepager.checkpoints.default import default_model_path
from moepager.cli.generate import check_threads
from moepager.errors import MoepagerError
from moepager.planning.calibrate import CalibrateOptions, calibrate
from moepager.store.budget import format_bytes

HELP = "measure memory, expert compute, disk (and host->device) rates for a model; write a cost-model profile"
STEPS = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory whose geometry to measure (default: the built-in model)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's); calibrate with the run's own")
    p.add_argument("--io-threads", type=int, default=4, help="concurrent disk reads, as the store's (default 4)")
    p.add_argument("--prefill-tokens", type=int, default=64,
                   help="prompt length at which to measure the non-expert prefill time (default 64; use the length "
                        "you will model: attention grows faster than linearly)")
    p.add_argument("--out", metavar="PROFILE.json", help="write the profile here (for simulate --profile)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise MoepagerError(f"device '{args.device}' requested but CUDA is not available")
    check_threads(args.threads)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.io_threads < 1:
        raise MoepagerError(f"--io-threads must be >= 1, got {args.io_threads}")
    if args.prefill_tokens < 2:
        raise MoepagerError(f"--prefill-tokens must be >= 2, got {args.prefill_tokens}")
    out = check_file(args.out, "--out", args.force, {"--model": args.model or str(default_model_path())})
    path = args.model or default_model_path()
    steps = STEPS + (1 if args.device.startswith("cuda") else 0)
    with tqdm(total=steps, desc="calibrating", unit="step", disable=args.quiet) as bar:
        def step(name: str) -> None:
            bar.set_postfix_str(name)
            bar.update()
        profile = calibrate(path, CalibrateOptions(args.device, args.io_threads, prefill_tokens=args.prefill_tokens),
                            step)
    m, c = profile.measured, profile.calibration
    rows = [("profile", profile.name),
            ("memory copy", f"{m['copy_Bps'] / 1e9:.1f} GB/s"),
            ("expert", f"{format_bytes(c.expert_bytes)}: {c.expert_s_1 * 1e3:.3f} ms at 1 token, "
                       f"{c.expert_s_64 * 1e3:.3f} ms at 64 ({c.expert_bytes / c.expert_s_1 / 1e9:.1f} GB/s at 1)"),
            ("per-expert overhead", f"{m['expert_overhead_s'] * 1e6:.0f} us"),
            ("non-expert time", f"{c.dense_decode_s * 1e3:.2f} ms per decode step at {c.dense_decode_kv:.0f} cached "
                                f"positions, +{c.dense_kv_s * 1e6:.1f} us per further position; "
                                f"+{c.dense_token_s * 1e3:.3f} ms per further prefill token"),
            ("disk", f"{m['disk_Bps'] / 1e9:.2f} GB/s with {args.io_threads} reads at once; one read "
                     f"{m['disk_single_read_s'] * 1e3:.1f} ms (random experts)"),
            ("compute beside reads", f"{100 * m['io_slowdown']:.0f}% slower while disk reads run")]
    if "h2d_Bps" in m:
        rows.append(("host->device", f"{m['h2d_Bps'] / 1e9:.1f} GB/s from pinned memory"))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    if out is not None:
        profile.write(out)
        print(f"profile: {args.out} (use it: moepager simulate TRACE --profile {args.out})")
    return 0
