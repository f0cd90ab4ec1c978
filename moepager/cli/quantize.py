"""`moepager quantize`: a checkpoint whose routed experts are stored as int8 or int4 (checkpoints/quantized.py)."""

from __future__ import annotations

import argparse

from moepager.checkpoints.default import default_model_path
from moepager.checkpoints.quantized import quantize_checkpoint
from moepager.config import INT4_GROUPS
from moepager.errors import MoepagerError

HELP = "write a copy of a checkpoint with its routed experts quantized to int8 or int4 (lossy; smaller reads)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="float checkpoint directory (default: the built-in model)")
    p.add_argument("--experts", required=True, choices=["int8", "int4"],
                   help="int8: one scale per output channel; int4: one scale per group of input elements")
    p.add_argument("--int4-group", type=int, choices=INT4_GROUPS, help="int4: elements per scale (default 32)")
    p.add_argument("--int4-zero-points", action="store_true",
                   help="int4: a zero point per group (default: symmetric, llama.cpp's Q4_0)")
    p.add_argument("--out", required=True, help="output directory (must not exist, or be empty)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")


def run(args: argparse.Namespace) -> int:
    if args.experts != "int4" and (args.int4_group is not None or args.int4_zero_points):
        raise MoepagerError("--int4-group and --int4-zero-points apply to --experts int4")
    out = quantize_checkpoint(args.model or default_model_path(), args.out, args.experts, args.int4_group or 32,
                              args.int4_zero_points, force=args.force)
    print(f"wrote {out} (run it: moepager generate --model {out} PROMPT)")
    return 0
