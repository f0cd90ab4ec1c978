"""`moepager info [--model PATH]`: architecture, geometry and where the bytes are (reads headers only)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from moepager.accel import cpu_kernels
from moepager.checkpoints.default import default_model_path
from moepager.checkpoints.derived import split_parts
from moepager.checkpoints.disk import bounce_bytes
from moepager.checkpoints.dtypes import checkpoint_dtype
from moepager.checkpoints.expert_reader import is_routed_expert
from moepager.checkpoints.gguf_read import resolve_model_path
from moepager.checkpoints.quantized import expert_format, stored_format
from moepager.checkpoints.safetensors import Checkpoint
from moepager.config import Budget, EngineConfig, StoreConfig
from moepager.experts.weights import ExpertShape
from moepager.loading.build import LoadOptions, open_checkpoint
from moepager.models.registry import architecture_for, tensor_specs
from moepager.placements.base import expert_times
from moepager.placements.fit import fit_of, fitted
from moepager.placements.stores import stream_rows
from moepager.store.budget import format_bytes
from moepager.store.budget import format_bytes as size

HELP = "describe a checkpoint: architecture, layers, experts, parameter counts and bytes per expert"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face checkpoint directory (default: the built-in demo model)")
    p.add_argument("--expert-memory", metavar="SIZE", action="append", default=[],
                   help="also show how many experts this budget holds (repeatable; e.g. 6GiB, 25%%)")


def count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def describe(path: str, budgets: Sequence[str] = ()) -> list[tuple[str, str]]:
    ckpt = Checkpoint(resolve_model_path(path, tensor_specs))
    cfg = architecture_for(ckpt.config).parse_config(ckpt.config)
    dtype, stored, parts = checkpoint_dtype(ckpt), stored_format(ckpt.config), split_parts(ckpt.config)
    per_expert = 3 * cfg.hidden_size * cfg.expert_intermediate_size
    experts = per_expert * cfg.num_moe_layers * cfg.num_experts
    total = experts + sum(loc.nbytes // loc.dtype.itemsize for n, loc in ckpt.locations.items()
                          if not is_routed_expert(n))
    active = total - experts + per_expert * cfg.num_moe_layers * cfg.top_k
    quant = expert_format(None, stored, dtype, torch.device("cpu"))  # what a run holds by default
    shape = ExpertShape(cfg.hidden_size, cfg.expert_intermediate_size, dtype, quant)
    expert_nbytes, num_routed = shape.nbytes, cfg.num_moe_layers * cfg.num_experts
    defaults = StoreConfig()
    buffers = (defaults.io_threads + defaults.prefetch_threads) * bounce_bytes(expert_nbytes)  # stored = run dtype
    return [
        ("architecture", cfg.architecture),
        ("layers", f"{cfg.num_layers} ({cfg.num_moe_layers} MoE)"),
        ("experts per MoE layer", f"{cfg.num_experts}, top-{cfg.top_k}" + (
            f", + shared ({cfg.shared_intermediate_size} wide)" if cfg.shared_intermediate_size else "")),
        ("hidden / expert FFN", f"{cfg.hidden_size} / {cfg.expert_intermediate_size}"),
        *([("split", f"each expert stored in {parts} parts of {cfg.expert_intermediate_size // parts} (moepager split; "
                     "a run pages parts, the budgets below hold their bytes)")] if parts > 1 else []),
        ("vocabulary", f"{cfg.vocab_size}"),
        ("context", f"{cfg.max_position_embeddings}"),
        ("dtype on disk", str(dtype).removeprefix("torch.")),
        ("expert format", shape.format_name + (" (lossy; the format a run holds by default)" if quant else "")),
        ("parameters", f"{count(total)} total, {count(active)} active per token"),
        ("expert parameters", f"{count(experts)} ({100 * experts / total:.1f}%)"),
        ("non-expert parameters", count(total - experts)),
        ("bytes per expert", size(expert_nbytes)),
        ("all experts", f"{num_routed} experts, {size(num_routed * expert_nbytes)}"),
        ("non-expert weights", size((total - experts) * dtype.itemsize) + " (always resident)"),
        ("read buffers", f"{size(buffers)} (O_DIRECT bounce buffers of {defaults.io_threads} I/O threads + "
                         f"{defaults.prefetch_threads} prefetch; inside every --expert-memory budget on the CPU, "
                         "--host-memory on CUDA)"),
        ("CPU expert kernels", cpu_kernels.status()),
        ("minimum expert memory", f"{size(cfg.top_k * expert_nbytes + buffers)} (one MoE layer's top-{cfg.top_k} "
                                  f"+ read buffers)"),
        ("fit on this machine", fit_row(ckpt.path)),
    ] + [budget_row(text, expert_nbytes, num_routed, cfg.top_k, buffers) for text in budgets]


def fit_row(path: Path) -> str:
    """What a CPU run of this checkpoint with no --expert-memory chooses here (placements/fit.py), at the default
    options."""
    config = EngineConfig()
    opened = open_checkpoint(path, LoadOptions.of(config))
    fit = fit_of(config, opened)
    if fit.left < fit.least:
        return f"does not fit: {format_bytes(max(fit.left, 0))} left for experts, below {format_bytes(fit.least)}"
    times = expert_times(config, opened.device, opened.reader.shape.nbytes)[0]
    return fitted(config, opened, times)[1].removeprefix("fit: ")


def budget_row(text: str, expert_nbytes: int, num_routed: int, minimum: int, buffers: int) -> tuple[str, str]:
    slots = Budget.parse(text, "--expert-memory").slots(expert_nbytes, num_routed, buffers)
    verdict = "below the minimum" if slots < minimum else f"{100 * slots / num_routed:.1f}% of experts"
    streams = stream_rows(slots, num_routed)
    held = f": {slots - streams} cached + {streams} stream rows" if streams else ""
    return f"--expert-memory {text}", (f"{slots} experts ({size(slots * expert_nbytes)} + {size(buffers)} read "
                                       f"buffers){held}, {verdict}")


def run(args: argparse.Namespace) -> int:
    rows = describe(str(args.model or default_model_path()), args.expert_memory)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
