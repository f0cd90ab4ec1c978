"""`moepager make-model`: write a random-weight HF checkpoint (with tokenizer) at a real model's geometry, or the
same weights as a GGUF file."""

from __future__ import annotations

import argparse

from moepager.loading.synth import make_model
from moepager.loading.synth_presets import ARCH_TYPES, PRESET_NAMES

HELP = "write a random-weight Hugging Face checkpoint at a real model's geometry (or a tiny test one)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", required=True, choices=PRESET_NAMES)
    p.add_argument("--arch", choices=sorted(ARCH_TYPES), help="architecture (required for --preset tiny)")
    p.add_argument("--layers", type=int, help="override the number of decoder layers")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True,
                   help="output directory (must not exist, or be empty); a path ending in .gguf writes a GGUF file "
                        "instead (bfloat16 or float16), which llama.cpp and moepager --model FILE.gguf both read")
    p.add_argument("--force", action="store_true",
                   help="replace a non-empty --out (its old files, shards and index included, are removed)")


def run(args: argparse.Namespace) -> int:
    out = make_model(args.out, args.preset, args.arch, args.layers, args.dtype, args.seed, force=args.force)
    print(f"wrote {out}")
    return 0
