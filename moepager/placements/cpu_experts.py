"""The placement `cpu-experts` (llama.cpp's --cpu-moe): every routed expert in host RAM (--host-memory: the rest
paged from disk), computed on the CPU, whatever the run's device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from moepager.config import EngineConfig
from moepager.experts.executor import ExpertExecutor
from moepager.experts.hybrid import CpuExpertsExecutor, CpuPool
from moepager.experts.protocols import FlatReader
from moepager.loading.build import ExecutorFactory, resident_executor
from moepager.models.config import ModelConfig
from moepager.placements.base import BuildContext, Placed
from moepager.placements.paged import paged_store_executor


class CpuExperts:
    name = "cpu-experts"
    splits = False
    configurable = False
    option = "--execution cpu-experts"

    def build(self, ctx: BuildContext) -> Placed:
        opened = ctx.opened
        executor = cpu_experts_executor(ctx.config, opened.device)(opened.reader, opened.config, ctx.progress)
        assert isinstance(executor, CpuExpertsExecutor)
        return Placed(executor, executor.store, "cpu-experts: every routed expert computes on the CPU")


def cpu_experts_executor(config: EngineConfig, device: torch.device) -> ExecutorFactory:
    """A load_model executor factory for `--execution cpu-experts`: every routed expert in host RAM (--host-memory,
    the rest paged from disk) computed on the CPU."""
    def make(reader: FlatReader, cfg: ModelConfig, progress: Callable[[int], None]) -> ExpertExecutor:
        cpu, kernel = torch.device("cpu"), config.expert_kernel
        if config.store.host_memory is not None:  # host RAM as a CPU run's device tier, over disk
            store_config = replace(config.store, expert_memory=config.store.host_memory, host_memory=None)
            inner: ExpertExecutor = paged_store_executor(store_config, reader, cfg, cpu, kernel, False, progress)
        else:
            inner = resident_executor(cpu, kernel)(reader, cfg, progress)  # type: ignore[arg-type]
        return CpuExpertsExecutor(inner, device, CpuPool(config.placement.cpu_threads or config.threads))
    return make
