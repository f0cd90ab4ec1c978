"""Building a model from a checkpoint directory: config -> architecture -> experts -> module -> weights.

Routed experts are read one by one through an `ExpertReader` into the `ExpertExecutor` the caller chooses
(all resident in one arena by default); the module is then built around that executor on the meta device,
cast to the run's dtype while still empty, materialised, and filled with the non-expert weights.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from tqdm import tqdm

from moepager.accel import cpu_kernels
from moepager.accel.dense_quant import check_dense_dtype, quantize_dense
from moepager.accel.packed import pack_dense as pack_dense_projections
from moepager.accel.step import step_backend
from moepager.checkpoints.derived import SplitLayout
from moepager.checkpoints.dtypes import checkpoint_dtype, parse_dtype
from moepager.checkpoints.expert_reader import ExpertReader, is_routed_expert
from moepager.checkpoints.gguf_read import resolve_model_path
from moepager.checkpoints.quantized import expert_format, stored_format
from moepager.checkpoints.safetensors import Checkpoint, TensorLocation, load_module_weights
from moepager.checkpoints.split import layout_of
from moepager.config import DENSE_FORMATS, DirectIO, EngineConfig, Kernel
from moepager.errors import CheckpointError
from moepager.experts.executor import ExpertExecutor, PackedExecutor, ResidentExecutor
from moepager.experts.quant import check_shape
from moepager.experts.split import SplitExecutor
from moepager.experts.weights import ExpertShape
from moepager.models.backend import Backend
from moepager.models.base import Architecture
from moepager.models.config import ModelConfig
from moepager.models.layers import CausalLM
from moepager.models.registry import architecture_for, tensor_specs
from moepager.types import ExpertKey, host_empty, rehome_on_huge_pages

FP32_TENSORS = ("e_score_correction_bias",)
"""Tensors kept in fp32 whatever the model dtype (as transformers does)."""

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
    execution: str = ""
    """Where routed experts compute when not only on the device (`--execution`), and why (what a run reports)."""


def read_resident(reader: ExpertReader, moe_layers: list[int], num_experts: int, device: torch.device,
                  progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """Every routed expert read into one arena on `device`: row i * num_experts + e is expert e of MoE layer i."""
    return read_experts(reader, [ExpertKey(layer, e) for layer in moe_layers for e in range(num_experts)], device,
                        progress)


def read_experts(reader: ExpertReader, keys: Sequence[ExpertKey], device: torch.device,
                 progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """The experts `keys` read into one arena on `device`, row i expert keys[i] (through one CPU staging buffer when
    the device is not the CPU)."""
    shape = reader.shape
    arena = host_empty(len(keys), shape.numel, dtype=shape.buffer_dtype) if device.type == "cpu" else \
        torch.empty(len(keys), shape.numel, dtype=shape.buffer_dtype, device=device)
    staging = torch.empty(shape.numel, dtype=shape.buffer_dtype) if device.type != "cpu" else None
    for key, row in zip(keys, arena):
        if staging is None:
            reader.read(key, row)
        else:
            reader.read(key, staging)
            row.copy_(staging)
        if progress is not None:
            progress(shape.nbytes)
    return arena


def resident_executor(device: torch.device, kernel: Kernel = "auto") -> ExecutorFactory:
    def make(reader: ExpertReader, cfg: ModelConfig, progress: Callable[[int], None]) -> ExpertExecutor:
        if kernel == "packed":  # a layer at a time, each arena dropped once packed
            arenas = (read_resident(reader, [layer], cfg.num_experts, device, progress) for layer in cfg.moe_layers)
            return PackedExecutor(arenas, reader.shape, cfg.moe_layers, cfg.num_experts, device)
        fused = cpu_kernels.fused_experts(reader.shape, device, kernel)
        arena = read_resident(reader, cfg.moe_layers, cfg.num_experts, device, progress)
        return ResidentExecutor(arena, reader.shape, cfg.moe_layers, cfg.num_experts, kernel, fused)
    return make


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """A checkpoint's parsed configuration, without loading any weights (to validate options up front)."""
    checkpoint = Checkpoint(resolve_model_path(path, tensor_specs))
    return architecture_for(checkpoint.config).parse_config(checkpoint.config)


def open_experts(checkpoint: Checkpoint, arch: Architecture, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device, direct_io: DirectIO = "auto", expert_dtype: str | None = None,
                 int4_group: int | None = None, int4_zero_point: bool | None = None,
                 kernel: Kernel = "auto", split: SplitLayout | None = None) -> ExpertReader:
    """The reader of the checkpoint's routed experts in the format a run holds them (`expert_dtype`; None: as
    stored, so a `moepager quantize` checkpoint in its own format); its `shape` is that format's. int4 experts that
    the fused CPU kernel computes (`kernel` auto or fused, accel/cpu_kernels.py) are held as plain nibbles, which it
    reads, rather than in torch's int4pack layout. `split`: the checkpoint stores each expert in parts, which the
    reader reads as experts (their geometry `split.paging_config(cfg)`)."""
    if split is not None:
        cfg = split.paging_config(cfg)
    stored = stored_format(checkpoint.config)
    quant = expert_format(expert_dtype, stored, dtype, device, int4_group, int4_zero_point)
    if quant is not None:
        check_shape(cfg.hidden_size, cfg.expert_intermediate_size, quant)
    shape = ExpertShape(cfg.hidden_size, cfg.expert_intermediate_size, dtype, quant)
    if quant is not None and quant.layout == "cpu":
        rows = replace(shape, quant=replace(quant, layout="rows"))
        if cpu_kernels.applies(rows, device, kernel):
            shape = rows
    return ExpertReader(checkpoint, arch.expert_naming, shape, cfg.moe_layers[0] if cfg.moe_layers else 0,
                        direct_io, stored, split)


@dataclass(frozen=True)
class LoadOptions:
    """How a checkpoint is turned into a model (the parts of an EngineConfig the model itself needs)."""

    dtype: torch.dtype | None = None
    """Compute dtype; None keeps the checkpoint's."""
    device: str = "cpu"
    """Where the model computes: cpu or cuda[:N]."""
    direct_io: DirectIO = "auto"
    """O_DIRECT reads of the routed experts (checkpoints/disk.py)."""
    expert_dtype: str | None = None
    """bf16/fp16/fp32/int8/int4 (int8/int4 lossy, opt-in: experts/quant.py); None: as stored."""
    int4_group: int | None = None
    """int4: input elements per scale; None: 32, or a quantized checkpoint's."""
    int4_zero_point: bool | None = None
    """int4: a zero point per group; None: symmetric, or a quantized checkpoint's."""
    dense_dtype: str | None = None
    """int8: the dense projections quantized too (accel/dense_quant.py; lossy, opt-in)."""
    pack_dense: bool = True
    """Prepack the large bf16 dense projections for oneDNN on the CPU (accel/packed.py)."""
    expert_kernel: Kernel = "auto"
    """The expert kernel the run asks for: where it is the fused CPU kernel, int4 experts are held in its layout."""
    expert_device: str | None = None
    """Where the routed experts are held and computed when it is not `device` (the placement's: the CPU for
    `--execution cpu-experts`): their format is that device's."""

    @classmethod
    def of(cls, config: EngineConfig) -> LoadOptions:
        return cls(parse_dtype(config.dtype) if config.dtype else None, config.device, config.store.direct_io,
                   config.experts.dtype, config.experts.int4_group, config.experts.int4_zero_point, config.dense_dtype,
                   config.pack_dense, config.expert_kernel, config.placement.expert_device)


class WindowBytes(NamedTuple):
    """The dense weights read in MoEpic's prefetch windows (OpenCheckpoint.window_bytes)."""

    per_layer: float
    """A MoE layer's non-expert weights (the mean over MoE layers): T_att's reads."""
    head: int
    """What runs between a token's last MoE layer and the next token's first: T_head's reads."""


@dataclass
class OpenCheckpoint:
    """A checkpoint opened for a run: its architecture and configuration, the run's dtype and device, and the reader
    of its routed experts in the format the run holds them (nothing loaded yet)."""

    checkpoint: Checkpoint
    arch: Architecture
    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    reader: ExpertReader

    @property
    def split(self) -> SplitLayout | None:
        """How the checkpoint stores each expert in parts (`moepager split`); None: whole."""
        return self.reader.split

    @property
    def paging(self) -> ModelConfig:
        """The configuration stores and executors size themselves by: the model's, or a split checkpoint's parts as
        experts (checkpoints/split.py)."""
        return self.split.paging_config(self.config) if self.split is not None else self.config

    def _run_bytes(self, loc: TensorLocation) -> int:
        """A stored dense tensor's bytes in the run's dtype."""
        return loc.nbytes // loc.dtype.itemsize * self.dtype.itemsize

    def total_bytes(self) -> int:
        """Bytes a load moves: every dense weight in the run's dtype and every routed expert in its format."""
        dense = sum(self._run_bytes(loc) for name, loc in self.checkpoint.locations.items()
                    if not is_routed_expert(name))
        return dense + self.paging.num_moe_layers * self.paging.num_experts * self.reader.shape.nbytes

    def window_bytes(self) -> WindowBytes:
        """The dense weights a decode token reads in the windows MoEpic's configurator prefetches in (MoEpic eq. 7),
        in the run's dtype: (per MoE layer, the mean of its non-expert weights: attention, router, shared experts,
        norms; what runs before the first MoE layer: the LM head and final norm, every decoder layer without
        routed experts, and the embedding row read). A tied embedding counts once, as the LM head; layers past
        num_hidden_layers (DeepSeek-V3's multi-token prediction) do not run in decode."""
        by_layer: dict[int, int] = {}
        rest = 0
        for name, loc in self.checkpoint.locations.items():
            if is_routed_expert(name) or ("embed_tokens" in name and not self.config.tie_word_embeddings):
                continue
            nbytes = self._run_bytes(loc)
            m = LAYER_NAME.search(name)
            layer = int(m.group(1)) if m else -1
            if 0 <= layer < self.config.num_layers:
                by_layer[layer] = by_layer.get(layer, 0) + nbytes
            elif layer < 0:
                rest += nbytes
        moe = set(self.config.moe_layers)
        per_moe = [by_layer.get(layer, 0) for layer in moe]
        head = rest + sum(b for layer, b in by_layer.items() if layer not in moe)
        head += self.config.hidden_size * self.dtype.itemsize  # the embedding row
        return WindowBytes(sum(per_moe) / len(per_moe) if per_moe else 0.0, head)


LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_layers_stored(checkpoint: Checkpoint, cfg: ModelConfig) -> None:
    """The checkpoint's decoder-layer tensors are those of config.json's layers: weights of layers past them (a
    num_hidden_layers edited down) would be ignored in silence. DeepSeek-V3's multi-token-prediction layers
    (`num_nextn_predict_layers`) follow the last decoder layer and are allowed."""
    extra = int(cfg.raw.get("num_nextn_predict_layers") or 0)
    stored = {int(m.group(1)) for name in checkpoint.locations if (m := LAYER_NAME.search(name))}
    beyond = sorted(i for i in stored if i >= cfg.num_layers + extra)
    if beyond:
        raise CheckpointError(f"{checkpoint.path} holds weights of decoder layers up to {max(stored)}, but its "
                              f"config.json says num_hidden_layers {cfg.num_layers}: layers {beyond[0]}.."
                              f"{beyond[-1]} would be ignored; fix config.json")


def open_checkpoint(path: str | os.PathLike[str], options: LoadOptions) -> OpenCheckpoint:
    """The checkpoint at `path` opened for a run with `options` (clear errors for options it cannot take)."""
    check_dense_dtype(options.dense_dtype, options.device)
    checkpoint = Checkpoint(path)
    arch = architecture_for(checkpoint.config)
    cfg = arch.parse_config(checkpoint.config)
    check_layers_stored(checkpoint, cfg)
    split = layout_of(checkpoint.config, cfg)
    dtype = options.dtype or checkpoint_dtype(checkpoint)
    dev = torch.device(options.device)
    reader = open_experts(checkpoint, arch, cfg, dtype, torch.device(options.expert_device or dev),
                          options.direct_io, options.expert_dtype, options.int4_group, options.int4_zero_point,
                          options.expert_kernel, split)
    return OpenCheckpoint(checkpoint, arch, cfg, dtype, dev, reader)


def build_model(opened: OpenCheckpoint, experts: ExpertExecutor, options: LoadOptions,
                progress: Callable[[int], None]) -> LoadedModel:
    """The model around an executor that already holds (or pages) the routed experts (a split checkpoint's parts:
    wrapped here, once, to compute whole experts), built on the meta device, cast to the run's dtype while still
    empty, materialised and filled with the dense weights, then quantized or prepacked as `options` ask."""
    checkpoint, cfg, dtype, dev = opened.checkpoint, opened.config, opened.dtype, opened.device
    if opened.split is not None:
        experts = SplitExecutor(experts, opened.split.parts)
    backend = step_backend(dtype, dev) if options.pack_dense else Backend()
    with torch.device("meta"):
        model = opened.arch.build(cfg, experts, backend)
    cast_model(model, dtype)
    model = model.to_empty(device="cpu")
    load_module_weights(model, checkpoint, lambda n: n if checkpoint.has(n) else model.disk_name(n), progress=progress)
    checkpoint.files.close()
    model.to(dev).eval()
    if options.dense_dtype is not None:
        quantize_dense(model, options.dense_dtype)
    packed = pack_dense_projections(model) if options.dense_dtype is None and options.pack_dense and dev.type == "cpu" \
        else ""
    if dev.type == "cpu":
        weights_on_huge_pages(model)
        steps = backend.fuse(model)
        if options.dense_dtype is None:  # (an int8 run's dense format stays "int8": its steps run the kernels too)
            packed = "; ".join(x for x in (packed, steps) if x)
    dense_format = DENSE_FORMATS[options.dense_dtype] if options.dense_dtype else str(dtype).removeprefix("torch.")
    if packed:
        dense_format += f" ({packed})"
    note = experts.compute_note  # a kernel that is lossier than the format says so
    shape = opened.reader.shape
    expert_fmt = shape.format_name + (f" ({note})" if note else "")
    return LoadedModel(checkpoint, cfg, model, experts, shape, dtype, dev, dense_format, expert_fmt)


def load_bar(opened: OpenCheckpoint, show_progress: bool) -> tqdm:
    """The progress bar of a load (experts and dense weights)."""
    return tqdm(total=opened.total_bytes(), unit="B", unit_scale=True, desc="loading", disable=not show_progress,
                leave=False)


def weights_on_huge_pages(model: torch.nn.Module) -> None:
    """Move the model's large CPU weights (parameters and buffers of 2 MiB or more: the embedding, the LM head,
    attention and dense projections) onto huge pages (types.py `host_empty`), ties kept."""
    named = [(m, n) for m in model.modules() for n, t in list(m._parameters.items()) + list(m._buffers.items())
             if t is not None]

    def current() -> Iterator[torch.Tensor]:  # each weight as it is when its copy is asked for (nothing else held)
        for module, name in named:
            t = module._parameters.get(name)
            yield (t if t is not None else module._buffers[name]).data

    for (module, name), new in zip(named, rehome_on_huge_pages(current())):
        old = module._parameters.get(name)
        if old is not None:
            if new is not old.data:
                old.data = new
        elif new is not module._buffers[name]:
            module._buffers[name] = new


def cast_model(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating tensors to `dtype`, except those transformers keeps in fp32."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not name.endswith(FP32_TENSORS):
            t.data = t.data.to(dtype)
