"""Split experts (MoEpic's vertical split, MoEpic §3.2): a checkpoint whose routed experts are stored in S parts.

An expert's SwiGLU output is a sum over its intermediate dimension F, so it is exactly the sum of S narrower experts
("parts"), part j taking gate and up rows [j·F/S, (j+1)·F/S) and the same columns of down:

    expert(x) = down · (silu(gate·x) * up·x) = Σ_j down[:, P_j] · (silu(gate[P_j]·x) * up[P_j]·x)

`moepager split --parts S` writes a copy of a checkpoint where each routed expert e of a layer is replaced by its S
parts, stored as experts e·S + j of F/S each in the architecture's per-expert naming, each part's gate, up and down
one after another, so one part is one contiguous read, and the first t parts of an expert (its top segment, θ = t/S)
are one contiguous run of the file. The router is unchanged (E experts); a run of the copy routes each token to all
S parts of each of its experts with the expert's weight (experts/split.py), caches the top parts and streams the
bottom ones (store/store.py). What changes is the summation order (a token sums S·K weighted parts instead of K
experts), so outputs agree with the unsplit model to rounding, not bit for bit (tests/checkpoints/test_split.py
states the tolerance).

The config keeps the original's and adds `moepager_split: {"parts": S}`; the copy takes bf16/fp16/fp32 experts
(quantize at run time with --expert-dtype, each part with its own scales) and refuses a quantized original.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from moepager.atomic_io import check_dir
from moepager.checkpoints.derived import PARTS, SPLIT_KEY, SplitLayout, split_parts, write_derived
from moepager.checkpoints.dtypes import checkpoint_dtype
from moepager.checkpoints.expert_reader import ExpertReader
from moepager.checkpoints.quantized import expert_tensor_names, stored_format
from moepager.checkpoints.safetensors import Checkpoint
from moepager.errors import CheckpointError, ConfigError
from moepager.experts.weights import ExpertShape, ExpertWeights
from moepager.models.config import ModelConfig
from moepager.models.specs import spec_for
from moepager.types import ExpertKey


def layout_of(config: dict[str, Any], cfg: ModelConfig) -> SplitLayout | None:
    """The split layout of a checkpoint (None: its experts are whole), checked against its geometry."""
    parts = split_parts(config)
    if parts == 1:
        return None
    if cfg.expert_intermediate_size % parts:
        raise CheckpointError(f"config.json says each expert is split in {parts} parts, which do not divide its "
                              f"intermediate size {cfg.expert_intermediate_size}")
    return SplitLayout(parts, cfg.num_experts, cfg.top_k, cfg.expert_intermediate_size)


def split_checkpoint(model: str | os.PathLike[str], out: str | os.PathLike[str], parts: int = 4,
                     shard_bytes: int = 4 << 30, force: bool = False, show_progress: bool = True) -> Path:
    """Write `model` with each routed expert stored as `parts` parts (see the module note) to `out`; returns `out`.
    Written into a temporary sibling directory and renamed when complete."""
    checkpoint = Checkpoint(model)
    if stored_format(checkpoint.config) is not None:
        raise ConfigError(f"{checkpoint.path} holds quantized experts; split its float original (and quantize at run "
                          "time with --expert-dtype)")
    if split_parts(checkpoint.config) != 1:
        raise ConfigError(f"{checkpoint.path} is split already; split its original")
    if parts not in PARTS:
        raise ConfigError(f"--parts must be one of {', '.join(map(str, PARTS))}, not {parts}")
    spec = spec_for(checkpoint.config)
    cfg = spec.parse_config(checkpoint.config)
    d, f = cfg.hidden_size, cfg.expert_intermediate_size
    if f % parts:
        raise ConfigError(f"{parts} parts do not divide the experts' intermediate size {f}; choose from "
                          f"{', '.join(str(p) for p in PARTS if f % p == 0) or 'none'}")
    out_dir = check_dir(out, "--out", force, {"--model": checkpoint.path})
    shape = ExpertShape(d, f, checkpoint_dtype(checkpoint))
    reader = ExpertReader(checkpoint, spec.expert_naming, shape, cfg.moe_layers[0] if cfg.moe_layers else 0, "off")
    replaced = expert_tensor_names(reader, cfg.moe_layers, cfg.num_experts)
    entries = [(name, loc.dtype, loc.shape) for name, loc in checkpoint.locations.items() if name not in replaced]
    width, naming = f // parts, spec.expert_naming
    sources: dict[str, tuple[ExpertKey, int, int]] = {}  # name -> (whole expert, part, projection 0/1/2)
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            for j in range(parts):  # each part's three tensors in a row: one contiguous read
                for proj, template, shp in ((0, naming.gate, (width, d)), (1, naming.up, (width, d)),
                                            (2, naming.down, (d, width))):
                    name = template.format(layer=layer, expert=e * parts + j)
                    entries.append((name, shape.dtype, shp))
                    sources[name] = (ExpertKey(layer, e), j, proj)
    scratch = ExpertWeights.empty(shape)
    current: list[ExpertKey] = []

    def produce(name: str) -> torch.Tensor:
        if name not in sources:
            t = torch.empty(checkpoint.locations[name].shape, dtype=checkpoint.locations[name].dtype)
            checkpoint.read_exact_into(name, t)
            return t
        key, j, proj = sources[name]
        if current != [key]:  # an expert's parts are written one after another: read it once
            reader.read(key, scratch.buffer)
            current[:] = [key]
        rows = slice(j * width, (j + 1) * width)
        if proj == 2:
            return scratch.down_DF[:, rows].contiguous()
        return scratch.gate_up_2FD[proj * f:][rows].contiguous()

    return write_derived(checkpoint, out_dir, force, entries, produce, shard_bytes, f"splitting ({parts} parts)",
                         show_progress, {SPLIT_KEY: {"parts": parts}},
                         f"> **A split copy.** `moepager split` wrote this checkpoint from `{checkpoint.path.name}` "
                         f"with each routed expert stored in {parts} parts (the same function, summed in another "
                         "order). The card below describes the original.")
