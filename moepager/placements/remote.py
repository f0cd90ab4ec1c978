"""The placement `remote` (OD-MoE, experts/remote/): routed experts held and computed by worker processes
(`--workers`); forecasts of a predictor become the workers' loads ahead. Also what a worker rank builds
(`expert_worker`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from moepager.accel import cpu_kernels
from moepager.config import Budget, EngineConfig, StoreConfig
from moepager.errors import ConfigError
from moepager.experts.executor import ArenaKernels, PagedExecutor
from moepager.experts.protocols import FlatReader
from moepager.experts.remote.executor import RemoteExecutor
from moepager.experts.remote.feed import ShadowFeed
from moepager.experts.remote.placement import Links, Placement
from moepager.experts.remote.protocol import SHADOW_RANK
from moepager.experts.remote.worker import ExpertWorker, Holding
from moepager.loading.build import LoadOptions, open_checkpoint, read_experts
from moepager.models.config import ModelConfig
from moepager.placements.base import BuildContext, Placed
from moepager.placements.stores import build_store, read_buffer_bytes
from moepager.policies.prefetch import PrefetchAware
from moepager.store.budget import check_slots
from moepager.types import ExpertKey


class Remote:
    name = "remote"
    splits = False
    configurable = False
    option = "--workers"

    def build(self, ctx: BuildContext) -> Placed:
        executor = remote_executor(ctx.config, ctx.opened.reader, ctx.opened.config, ctx.links)
        remote = ctx.config.remote
        feed = (ShadowFeed(remote.worker_timeout_s, remote.kv_align_period),) if remote.shadow else ()
        return Placed(executor, None, f"{remote.workers} worker processes", prefetch_view=executor,
                      pass_parts=(*feed, executor))


def placement(config: EngineConfig, cfg: ModelConfig) -> Placement:
    """Which worker holds each expert (experts/remote/placement.py), checked against the processes that were started."""
    import torch.distributed as dist

    processes = config.remote.workers + 1 + config.remote.shadow
    if not dist.is_initialized() or dist.get_world_size() != processes:
        raise ConfigError(f"--workers {config.remote.workers} needs {processes} processes started together: run "
                          f"`moepager generate --workers {config.remote.workers} ...` or `torchrun --nproc-per-node "
                          f"{processes} -m moepager.distributed generate ...`")
    first = 2 if config.remote.shadow else 1  # rank 1 is the shadow's
    return Placement(tuple(range(first, first + config.remote.workers)),
                     config.remote.worker_group or min(cfg.top_k, config.remote.workers), config.remote.assign,
                     config.remote.prefill)


def remote_executor(config: EngineConfig, reader: FlatReader, cfg: ModelConfig, links: Links) -> RemoteExecutor:
    """The main rank's executor: routed experts computed by the worker ranks, each on its link."""
    shape = reader.shape
    return RemoteExecutor(shape, cfg.moe_layers, cfg.num_experts, placement(config, cfg),
                          cpu_kernels.fused_experts(shape, torch.device("cpu"), config.expert_kernel),
                          config.remote.worker_timeout_s, config.remote.on_worker_loss,
                          also_placed=(SHADOW_RANK,) if config.remote.shadow else (),
                          links=links, priority=PrefetchAware.priority)


def expert_worker(config: EngineConfig, path: Path, rank: int, links: Links,
                  placed: Placement | None = None) -> ExpertWorker:
    """A worker rank's experts (what `Placement` may ask of it: `placed`, or the started processes'): read into RAM,
    or with `--worker-memory` paged from the checkpoint through a store of that many of them (one cache for all its
    layers); held again the same way when a failover changes its share."""
    opened = open_checkpoint(path, LoadOptions.of(config))
    cfg, reader = opened.config, opened.reader
    shape, kernel, cpu = reader.shape, config.expert_kernel, torch.device("cpu")
    fused = cpu_kernels.fused_experts(shape, cpu, kernel)

    def hold(owned: Sequence[tuple[int, int]], holds: Sequence[tuple[int, int]]) -> Holding:
        """Paged: a store over the checkpoint with a cache sized against its home share (`owned`; a worker whose group
        serves no layer, more groups than MoE layers, against what a spread prefill asks of it); resident: every
        expert it may be asked for (`holds`) read into one arena. Nothing for a worker that is asked for nothing."""
        if not holds:
            return None, None
        if config.remote.worker_memory is not None:
            share = len(owned) or len(holds)
            slots = Budget.parse(config.remote.worker_memory, "--worker-memory").slots(shape.nbytes, share)
            check_slots(slots, cfg.top_k, shape.nbytes, "--worker-memory", config.remote.worker_memory)
            store_config = StoreConfig(expert_memory=str(slots * shape.nbytes + read_buffer_bytes(reader, 4)),
                                       scope="global", policy=config.store.policy, warm=False)
            return None, PagedExecutor(build_store(store_config, reader, cfg, cpu, False), shape, kernel, fused)
        arena = read_experts(reader, [ExpertKey(cfg.moe_layers[p], e) for p, e in holds], cpu)
        return ArenaKernels(arena, shape, kernel, fused=fused), None

    return ExpertWorker(rank, cfg.moe_layers, cfg.num_experts, shape, placed or placement(config, cfg), hold, links,
                        shadow_rank=SHADOW_RANK if config.remote.shadow else None)
