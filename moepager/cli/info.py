"""`moepager info --model PATH`: architecture, geometry and where the bytes are (reads headers only)."""

from __future__ import annotations

import argparse

from moepager.models.load import checkpoint_dtype
from moepager.models.loader import Checkpoint
from moepager.models.registry import architecture_for

HELP = "describe a checkpoint: architecture, layers, experts, parameter counts and bytes per expert"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")


def count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def describe(path: str) -> list[tuple[str, str]]:
    ckpt = Checkpoint(path)
    cfg = architecture_for(ckpt.config).parse_config(ckpt.config)
    dtype = checkpoint_dtype(ckpt)
    total = sum(loc.nbytes // loc.dtype.itemsize for loc in ckpt.locations.values())
    per_expert = 3 * cfg.hidden_size * cfg.expert_intermediate_size
    experts = per_expert * cfg.num_moe_layers * cfg.num_experts
    active = total - experts + per_expert * cfg.num_moe_layers * cfg.top_k
    return [
        ("architecture", cfg.architecture),
        ("layers", f"{cfg.num_layers} ({cfg.num_moe_layers} MoE)"),
        ("experts per MoE layer", f"{cfg.num_experts}, top-{cfg.top_k}"
                                  + (f", + shared ({cfg.shared_intermediate_size} wide)" if cfg.shared_intermediate_size else "")),
        ("hidden / expert FFN", f"{cfg.hidden_size} / {cfg.expert_intermediate_size}"),
        ("vocabulary", f"{cfg.vocab_size}"),
        ("context", f"{cfg.max_position_embeddings}"),
        ("dtype on disk", str(dtype).removeprefix("torch.")),
        ("parameters", f"{count(total)} total, {count(active)} active per token"),
        ("expert parameters", f"{count(experts)} ({100 * experts / total:.1f}%)"),
        ("non-expert parameters", count(total - experts)),
        ("bytes per expert", size(per_expert * dtype.itemsize)),
        ("all experts", size(experts * dtype.itemsize)),
        ("non-expert weights", size((total - experts) * dtype.itemsize)),
    ]


def run(args: argparse.Namespace) -> int:
    rows = describe(args.model)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
