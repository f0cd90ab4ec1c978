"""`moepager export-gguf`: a checkpoint as a GGUF file llama.cpp runs (checkpoints/gguf_write.py)."""

from __future__ import annotations

import argparse

from moepager.checkpoints.default import default_model_path
from moepager.checkpoints.gguf_write import DENSE_EXPORT_TYPES, EXPORT_TYPES, export_gguf

HELP = "write a checkpoint (qwen3moe, qwen2moe, olmoe, mixtral, deepseek-v2/v3) as a GGUF file, tokenizer included"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the built-in model)")
    p.add_argument("--type", choices=EXPORT_TYPES, default="bf16",
                   help="bf16/f16: every matrix in that type; q8_0/q4_0: routed experts quantized as llama.cpp's "
                        "Q8_0/Q4_0 (lossy), every other tensor as stored")
    p.add_argument("--dense-type", choices=DENSE_EXPORT_TYPES,
                   help="also quantize the dense projections (attention, dense and shared-expert MLPs, the LM head) "
                        "as llama.cpp's Q8_0 (lossy; what moepager's --dense-dtype int8 quantizes)")
    p.add_argument("--out", required=True, help="the .gguf file to write")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")


def run(args: argparse.Namespace) -> int:
    out = export_gguf(args.model or default_model_path(), args.out, args.type, dense_type=args.dense_type,
                      force=args.force)
    print(f"wrote {out} (run it: moepager generate --model {out} PROMPT)")
    return 0
