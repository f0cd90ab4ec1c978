"""Building a model from a checkpoint directory: config -> architecture -> experts -> module -> weights.

Routed experts are read one by one through an `ExpertReader` into the `ExpertExecutor` the caller chooses
(all resident in one arena by default); the module is then built around that executor on the meta device,
cast to the run's dtype while still empty, materialised, and filled with the non-expert weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from moepager.errors import CheckpointError
from moepager.models.expert_reader import ExpertReader, is_routed_expert
from moepager.experts.executor import ExpertExecutor, Kernel, PackedExecutor, ResidentExecutor
from moepager.experts.quant import check_shape
from moepager.experts.weights import ExpertShape
from moepager.models.base import Architecture
from moepager.models.config import ModelConfig
from moepager.models.dense_quant import DENSE_FORMATS, check_dense_dtype, quantize_dense
from moepager.models.packed import pack_dense as pack_dense_projections
from moepager.models.layers import CausalLM
from moepager.models.loader import Checkpoint, load_module_weights
from moepager.models.registry import architecture_for
from moepager.store.disk import DirectIO
from moepager.types import ExpertKey

FP32_TENSORS = ("e_score_correction_bias",)
"""Tensors kept in fp32 whatever the model dtype (as transformers does)."""

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}

ExecutorFactory = Callable[[ExpertReader, ModelConfig, Callable[[int], None]], ExpertExecutor]


@dataclass
class LoadedModel:
    checkpoint: Checkpoint
    config: ModelConfig
    model: CausalLM
    experts: ExpertExecutor
    expert_shape: ExpertShape
    dtype: torch.dtype
    device: torch.device
    dense_format: str = ""
    """The format the dense projections compute in: the run's dtype, or int8 (`--dense-dtype`, lossy)."""
    expert_format: str = ""
    """The routed experts' format, and how their kernel computes when that is lossier still (what a run reports)."""


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype '{name}'; choose from {', '.join(DTYPES)}") from None


def checkpoint_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """The dtype the checkpoint stores its embeddings in (what a run uses unless told otherwise)."""
    loc = checkpoint.locations.get("model.embed_tokens.weight")
    return loc.dtype if loc is not None else parse_dtype(str(checkpoint.config.get("torch_dtype", "float32")))


def read_resident(reader: ExpertReader, moe_layers: list[int], num_experts: int, device: torch.device,
                  progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """Every routed expert read into one arena on `device`: row i * num_experts + e is expert e of MoE layer i
    (through one CPU staging buffer when the device is not the CPU)."""
    shape = reader.shape
    arena = torch.empty(len(moe_layers) * num_experts, shape.numel, dtype=shape.buffer_dtype, device=device)
    staging = torch.empty(shape.numel, dtype=shape.buffer_dtype) if device.type != "cpu" else None
    for i, layer in enumerate(moe_layers):
        for e in range(num_experts):
            row = arena[i * num_experts + e]
            if staging is None:
                reader.read(ExpertKey(layer, e), row)
            else:
                reader.read(ExpertKey(layer, e), staging)
                row.copy_(staging)
            if progress is not None:
                progress(shape.nbytes)
    return arena


def resident_executor(device: torch.device, kernel: Kernel = "auto") -> ExecutorFactory:
    def make(reader: ExpertReader, cfg: ModelConfig, progress: Callable[[int], None]) -> ExpertExecutor:
        if kernel == "packed":  # a layer at a time, each arena dropped once packed
            arenas = (read_resident(reader, [layer], cfg.num_experts, device, progress) for layer in cfg.moe_layers)
            return PackedExecutor(arenas, reader.shape, cfg.moe_layers, cfg.num_experts, device)
        arena = read_resident(reader, cfg.moe_layers, cfg.num_experts, device, progress)
        return ResidentExecutor(arena, reader.shape, cfg.moe_layers, cfg.num_experts, kernel)
    return make


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """A checkpoint's parsed configuration, without loading any weights (to validate options up front)."""
    from moepager.models.gguf_read import resolve_model_path

    checkpoint = Checkpoint(resolve_model_path(path))
    return architecture_for(checkpoint.config).parse_config(checkpoint.config)


def open_experts(checkpoint: Checkpoint, arch: Architecture, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device, direct_io: DirectIO = "auto", expert_dtype: str | None = None,
                 int4_group: int | None = None, int4_zero_point: bool | None = None) -> ExpertReader:
    """The reader of the checkpoint's routed experts in the format a run holds them (`expert_dtype`; None: as
    stored, so a `moepager quantize` checkpoint in its own format); its `shape` is that format's."""
    from moepager.models.quantized import expert_format, stored_format  # it imports this module

    stored = stored_format(checkpoint.config)
    quant = expert_format(expert_dtype, stored, dtype, device, int4_group, int4_zero_point)
    if quant is not None:
        check_shape(cfg.hidden_size, cfg.expert_intermediate_size, quant)
    shape = ExpertShape(cfg.hidden_size, cfg.expert_intermediate_size, dtype, quant)
    return ExpertReader(checkpoint, arch.expert_naming, shape, cfg.moe_layers[0] if cfg.moe_layers else 0,
                        direct_io, stored)


def load_model(path: str | os.PathLike[str], dtype: torch.dtype | None = None, device: str = "cpu",
               executor_factory: ExecutorFactory | None = None, show_progress: bool = True,
               direct_io: DirectIO = "auto", expert_dtype: str | None = None, int4_group: int | None = None,
               int4_zero_point: bool | None = None, dense_dtype: str | None = None,
               pack_dense: bool = True) -> LoadedModel:
    """A checkpoint ready to run. `expert_dtype` (bf16/fp16/fp32/int8/int4; None: as stored) is the format
    routed experts are held and computed in; int8/int4 are lossy and opt-in (experts/quant.py). `dense_dtype`
    int8 quantizes the dense projections too (models/dense_quant.py; lossy, opt-in). `pack_dense` prepacks the
    large bf16 dense projections for oneDNN on the CPU (models/packed.py)."""
    check_dense_dtype(dense_dtype, device)
    checkpoint = Checkpoint(path)
    arch = architecture_for(checkpoint.config)
    cfg = arch.parse_config(checkpoint.config)
    dtype = dtype or checkpoint_dtype(checkpoint)
    dev = torch.device(device)
    reader = open_experts(checkpoint, arch, cfg, dtype, dev, direct_io, expert_dtype, int4_group, int4_zero_point)
    shape = reader.shape
    dense = sum(loc.nbytes // loc.dtype.itemsize * dtype.itemsize for name, loc in checkpoint.locations.items()
                if not is_routed_expert(name))
    total = dense + cfg.num_moe_layers * cfg.num_experts * shape.nbytes
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading", disable=not show_progress,
              leave=False) as bar:
        experts = (executor_factory or resident_executor(dev))(reader, cfg, bar.update)
        with torch.device("meta"):
            model = arch.build(cfg, experts)
        cast_model(model, dtype)
        model = model.to_empty(device="cpu")
        load_module_weights(model, checkpoint, lambda n: n if checkpoint.has(n) else model.disk_name(n),
                            progress=bar.update)
        checkpoint.files.close()
    model.to(dev).eval()
    if dense_dtype is not None:
        quantize_dense(model, dense_dtype)
    packed = pack_dense_projections(model) if dense_dtype is None and pack_dense and dev.type == "cpu" else 0
    dense_format = DENSE_FORMATS[dense_dtype] if dense_dtype else str(dtype).removeprefix("torch.")
    if packed:
        dense_format += f" ({packed} large projection{'s' if packed > 1 else ''} prepacked for oneDNN)"
    note = getattr(experts, "compute_note", "")  # a kernel that is lossier than the format says so
    expert_fmt = shape.format_name + (f" ({note})" if note else "")
    return LoadedModel(checkpoint, cfg, model, experts, shape, dtype, dev, dense_format, expert_fmt)


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating tensors to `dtype`, except those transformers keeps in fp32."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not name.endswith(FP32_TENSORS):
            t.data = t.data.to(dtype)
