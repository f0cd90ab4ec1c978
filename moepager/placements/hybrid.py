"""The placement `hybrid` (SMoE, experts/hybrid.py): device slots at --expert-memory over a host tier; a layer's
experts missing from the device computed on the CPU where they are, unless copying them pays (`ExpertTimes`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moepager.accel import cpu_kernels
from moepager.config import EngineConfig
from moepager.experts.executor import ExpertExecutor
from moepager.experts.hybrid import CpuPool, ExpertTimes, HybridExecutor
from moepager.experts.protocols import FlatReader
from moepager.loading.build import ExecutorFactory
from moepager.models.config import ModelConfig
from moepager.placements.base import BuildContext, Placed, expert_times
from moepager.placements.stores import build_store


class Hybrid:
    name = "hybrid"
    splits = False
    configurable = False
    option = "--execution hybrid"

    def build(self, ctx: BuildContext) -> Placed:
        opened = ctx.opened
        executor = _hybrid(ctx.config, opened.reader, opened.config, opened.device, ctx.times, ctx.progress)
        return Placed(executor, executor.store, f"hybrid: {ctx.times.describe()} ({ctx.profile})")


def hybrid_executor(config: EngineConfig, device: torch.device, times: ExpertTimes | None = None) -> ExecutorFactory:
    """A load_model executor factory for `--execution hybrid` (`times`: the placement's costs; default the run's
    profile's)."""
    def make(reader: FlatReader, cfg: ModelConfig, progress: Callable[[int], None]) -> ExpertExecutor:
        return _hybrid(config, reader, cfg, device, times or expert_times(config, device, reader.shape.nbytes)[0],
                       progress)
    return make


def _hybrid(config: EngineConfig, reader: FlatReader, cfg: ModelConfig, device: torch.device, times: ExpertTimes,
            progress: Callable[[int], None]) -> HybridExecutor:
    """Device slots at --expert-memory over a host tier (--host-memory, default every expert), even on a CPU run,
    whose 'device' is then RAM computed by the calling thread (the data path, tested without a GPU)."""
    kernel = config.expert_kernel
    store = build_store(config.store, reader, cfg, device, True, progress)
    return HybridExecutor(store, reader.shape, kernel, cpu_kernels.fused_experts(reader.shape, device, kernel),
                          cpu_kernels.fused_experts(reader.shape, torch.device("cpu"), kernel), times,
                          CpuPool(config.placement.cpu_threads or config.threads), config.placement.hybrid_admit,
                          config.placement.hybrid_prefill)
