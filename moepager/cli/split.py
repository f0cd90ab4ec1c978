"""`moepager split`: a checkpoint whose routed experts are stored in parts (MoEpic's split; checkpoints/split.py)."""

from __future__ import annotations

import argparse

from moepager.checkpoints.default import default_model_path
from moepager.checkpoints.split import PARTS, split_checkpoint

HELP = ("write a copy of a checkpoint with each routed expert stored in parts, so a run can cache the top parts of "
        "more experts and stream the rest (MoEpic's split; the same model, summed in another order)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="float checkpoint directory (default: the built-in model)")
    p.add_argument("--parts", type=int, choices=PARTS, default=4,
                   help="parts per expert: the split ratio moves in steps of 1/PARTS (default 4)")
    p.add_argument("--out", required=True, help="output directory (must not exist, or be empty)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")


def run(args: argparse.Namespace) -> int:
    out = split_checkpoint(args.model or default_model_path(), args.out, args.parts, force=args.force)
    print(f"wrote {out} (run it with a split plan: moepager plan TRACE --expert-memory 25% --json P.json, then "
          f"moepager generate --model {out} --expert-memory 25% --layer-plan P.json PROMPT)")
    return 0
