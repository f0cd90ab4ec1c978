"""Quantized checkpoints: what `moepager quantize` writes, and which expert format a run uses.

A quantized checkpoint is a Hugging Face checkpoint whose routed experts are stored per expert, with the
architecture's own names (`...experts.{e}.gate_proj.weight` and so on, fused checkpoints included), as:
- `NAME`: the integers. int8: int8 [N, K]. int4: uint8 [N, K/2], two values per byte, the low nibble the
  even input index, each value q in [0, 15] standing for q - 8.
- `NAME_scale`: the scales in the checkpoint's dtype. int8: [N] (one per output channel); int4: [N, K/group].
- `NAME_zero` (int4 with zero points only): [N, K/group], same dtype.
The weight is w = q * scale (int8) or (q - 8) * scale + zero (int4); experts/quant.py has how they are chosen.
Every other tensor (attention, router, norms, embeddings, shared experts, LM head) is copied unchanged.

config.json gains
    "quantization_config": {"quant_method": "moepager", "format_version": 1, "experts": "int8" | "int4",
                            "group_size": 32 | 64 | 128 (int4), "zero_point": false | true (int4),
                            "modules": "routed experts"}
transformers does not read this method; moepager loads such a checkpoint and pages it like any other, so
disk reads and host copies shrink with it.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from moepager.atomic_io import check_dir
from moepager.checkpoints.derived import split_parts, write_derived
from moepager.checkpoints.dtypes import checkpoint_dtype
from moepager.checkpoints.expert_reader import ExpertLayout, ExpertReader
from moepager.checkpoints.safetensors import Checkpoint
from moepager.config import INT4_GROUPS, check_expert_options
from moepager.errors import CheckpointError, ConfigError
from moepager.experts.quant import (
    QuantFormat,
    QuantizedProjection,
    check_shape,
    parse_expert_dtype,
    projection_tensors,
    quantize_projection,
)
from moepager.experts.weights import ExpertShape, ExpertWeights
from moepager.models.config import ModelConfig
from moepager.models.naming import ExpertNaming
from moepager.models.specs import spec_for
from moepager.types import ExpertKey

QUANT_METHOD = "moepager"
FORMAT_VERSION = 1
FLOAT_EXPERT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def stored_format(config: dict[str, Any]) -> QuantFormat | None:
    """The format a checkpoint's config.json says its routed experts are stored in (None: float)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != QUANT_METHOD:
        raise CheckpointError(f"quantization method '{method}' is not supported; moepager reads float checkpoints, "
                              "its own int8/int4 checkpoints (`moepager quantize`) and GGUF files")
    if qc.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
        raise CheckpointError(f"quantization_config format_version {qc.get('format_version')} is newer than this "
                              f"moepager reads ({FORMAT_VERSION})")
    experts = qc.get("experts")
    if experts == "int8":
        return QuantFormat(8)
    if experts == "int4":
        group = qc.get("group_size")
        if group not in INT4_GROUPS:
            raise CheckpointError(f"quantization_config group_size {group!r} is not one of {INT4_GROUPS}")
        return QuantFormat(4, group, bool(qc.get("zero_point", False)), "plain")
    raise CheckpointError(f"quantization_config experts {experts!r} is not int8 or int4")


def quantization_config(fmt: QuantFormat) -> dict[str, Any]:
    qc: dict[str, Any] = {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION,
                          "experts": "int8" if fmt.bits == 8 else "int4"}
    if fmt.bits == 4:
        qc |= {"group_size": fmt.group, "zero_point": fmt.zero_point}
    return qc | {"modules": "routed experts"}


def expert_format(requested: str | None, stored: QuantFormat | None, dtype: torch.dtype, device: torch.device,
                  group: int | None = None, zero_point: bool | None = None) -> QuantFormat | None:
    """The format a run holds its routed experts in: `requested` (`--expert-dtype`; None: as stored), checked
    against what the checkpoint stores and the run's dtype. A quantized checkpoint runs in its own format or
    dequantized to float; it is never requantized to another one."""
    check_expert_options(requested, group, zero_point)
    layout = "cpu" if device.type == "cpu" else "plain"
    if requested is None:
        return None if stored is None else replace(stored, layout=layout)
    if requested in FLOAT_EXPERT_DTYPES:
        if FLOAT_EXPERT_DTYPES[requested] != dtype:
            raise ConfigError(f"--expert-dtype {requested} differs from the run's dtype "
                              f"{str(dtype).removeprefix('torch.')}: float experts compute in the run's dtype "
                              "(set it with --dtype)")
        return None
    if stored is not None:
        asked = parse_expert_dtype(requested, group or stored.group or 32,
                                   stored.zero_point if zero_point is None else zero_point, device)
        if asked is None or replace(asked, layout=stored.layout) != stored:
            raise ConfigError(f"this checkpoint stores {stored.name} experts; run it in that format (no "
                              "--expert-dtype) or dequantized (--expert-dtype bf16), or quantize its float original")
        return replace(stored, layout=layout)
    return parse_expert_dtype(requested, group or 32, bool(zero_point), device)


# ---- moepager quantize --------------------------------------------------------------------------------------


def expert_tensor_names(reader: ExpertReader, moe_layers: list[int], num_experts: int) -> set[str]:
    """Every stored tensor that holds routed expert weights (replaced in a quantized checkpoint)."""
    n = reader.naming
    if reader.layout is ExpertLayout.FUSED:
        return {name.format(layer=layer) for layer in moe_layers for name in (n.fused_gate_up, n.fused_down)}
    return {name.format(layer=layer, expert=e) for layer in moe_layers for e in range(num_experts)
            for name in (n.gate, n.up, n.down)}


def quantize_checkpoint(model: str | os.PathLike[str], out: str | os.PathLike[str], experts: str,
                        group: int = 32, zero_point: bool = False, shard_bytes: int = 4 << 30,
                        force: bool = False, show_progress: bool = True) -> Path:
    """Write `model` with its routed experts quantized (`experts`: int8 or int4) to `out`; returns `out`.
    Written into a temporary sibling directory and renamed when complete."""
    checkpoint = Checkpoint(model)
    if stored_format(checkpoint.config) is not None:
        raise ConfigError(f"{checkpoint.path} is already quantized; quantize its float original")
    if split_parts(checkpoint.config) != 1:
        raise ConfigError(f"{checkpoint.path} stores its experts in parts (moepager split); quantize its original, or "
                          "run this one with --expert-dtype int8/int4 (each part quantized when read)")
    if experts not in ("int8", "int4"):
        raise ConfigError(f"--experts must be int8 or int4, not '{experts}'")
    fmt = replace(parse_expert_dtype(experts, group, zero_point), layout="plain")  # the checkpoint's layout
    spec = spec_for(checkpoint.config)
    cfg = spec.parse_config(checkpoint.config)
    check_shape(cfg.hidden_size, cfg.expert_intermediate_size, fmt)
    out_dir = check_dir(out, "--out", force, {"--model": checkpoint.path})
    shape = ExpertShape(cfg.hidden_size, cfg.expert_intermediate_size, checkpoint_dtype(checkpoint))
    reader = ExpertReader(checkpoint, spec.expert_naming, shape, cfg.moe_layers[0] if cfg.moe_layers else 0, "off")
    replaced = expert_tensor_names(reader, cfg.moe_layers, cfg.num_experts)
    entries = [(name, loc.dtype, loc.shape) for name, loc in checkpoint.locations.items() if name not in replaced]
    sources = _quantized_entries(entries, cfg, spec.expert_naming, fmt, shape.dtype)
    scratch = ExpertWeights.empty(shape)
    current: dict[ExpertKey, tuple[QuantizedProjection, QuantizedProjection]] = {}

    def produce(name: str) -> torch.Tensor:
        if name not in sources:
            t = torch.empty(checkpoint.locations[name].shape, dtype=checkpoint.locations[name].dtype)
            checkpoint.read_exact_into(name, t)
            return t
        key, proj, suffix, rows = sources[name]
        if key not in current:  # the expert's tensors are written one after another: read and quantize it once
            current.clear()
            reader.read(key, scratch.buffer)
            current[key] = (quantize_projection(scratch.gate_up_2FD, fmt, shape.dtype),
                            quantize_projection(scratch.down_DF, fmt, shape.dtype))
        return current[key][proj].tensor(suffix)[rows].contiguous()

    return write_derived(checkpoint, out_dir, force, entries, produce, shard_bytes, f"quantizing ({fmt.name})",
                         show_progress, {"quantization_config": quantization_config(fmt)},
                         f"> **A quantized copy.** `moepager quantize` wrote this checkpoint from "
                         f"`{checkpoint.path.name}` with its routed experts in {fmt.name} (lossy). The card below "
                         "describes the float original: its measurements are not this copy's.")


def _quantized_entries(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], cfg: ModelConfig,
                       naming: ExpertNaming, fmt: QuantFormat, dtype: torch.dtype
                       ) -> dict[str, tuple[ExpertKey, int, str, slice]]:
    """Append every routed expert's quantized tensors to `entries`, expert by expert; returns where each comes
    from: (expert, projection 0 = gate_up / 1 = down, name suffix, rows of that projection)."""
    d, f = cfg.hidden_size, cfg.expert_intermediate_size
    sources: dict[str, tuple[ExpertKey, int, str, slice]] = {}
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            for proj, template, rows, k in ((0, naming.gate, slice(0, f), d), (0, naming.up, slice(f, 2 * f), d),
                                            (1, naming.down, slice(0, d), f)):
                base = template.format(layer=layer, expert=e)
                for suffix, dt, shp in projection_tensors(fmt, rows.stop - rows.start, k, dtype):
                    entries.append((base + suffix, dt, shp))
                    sources[base + suffix] = (ExpertKey(layer, e), proj, suffix, rows)
    return sources
