"""The placement `paged`: routed experts through the expert store (`--expert-memory`; on CUDA over a host tier,
`--host-memory`), computed on the run's device."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from moepager.accel import cpu_kernels
from moepager.config import Kernel, StoreConfig
from moepager.experts.executor import ExpertExecutor, PagedExecutor
from moepager.experts.protocols import FlatReader
from moepager.loading.build import ExecutorFactory
from moepager.models.config import ModelConfig
from moepager.placements.base import BuildContext, Placed
from moepager.placements.stores import build_store


class Paged:
    name = "paged"
    splits = True
    configurable = True
    option = ""

    def build(self, ctx: BuildContext) -> Placed:
        opened = ctx.opened
        executor = paged_store_executor(ctx.config.store, opened.reader, opened.paging, opened.device,
                                        ctx.config.expert_kernel, opened.device.type == "cuda", ctx.progress)
        return Placed(executor, executor.store)


def paged_executor(config: StoreConfig, device: torch.device, kernel: Kernel = "auto",
                   host_tier: bool | None = None) -> ExecutorFactory:
    """A load_model executor factory for the store; `host_tier` defaults to whether the device is CUDA."""
    def make(reader: FlatReader, cfg: ModelConfig, progress: Callable[[int], None]) -> ExpertExecutor:
        tier = device.type == "cuda" if host_tier is None else host_tier
        return paged_store_executor(config, reader, cfg, device, kernel, tier, progress)
    return make


def paged_store_executor(config: StoreConfig, reader: FlatReader, cfg: ModelConfig, device: torch.device,
                         kernel: Kernel, host_tier: bool, progress: Callable[[int], None]) -> PagedExecutor:
    """The paged executor over a store built from `config` (`host_tier`: over a host tier, else over disk)."""
    if reader.shape.quant is not None and reader.stored is None:
        print(f"warning: paging {reader.shape.format_name} experts out of a float checkpoint reads float bytes "
              "and quantizes every miss; `moepager quantize` writes a checkpoint that reads the quantized "
              "bytes", file=sys.stderr)
    fused = cpu_kernels.fused_experts(reader.shape, device, kernel)
    return PagedExecutor(build_store(config, reader, cfg, device, host_tier, progress, getattr(reader, "split", None)),
                         reader.shape, kernel, fused)
