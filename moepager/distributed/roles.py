"""The ranks' roles under torchrun (gloo): rank 0 runs the model with its routed experts on the other ranks,
which hold their share of the experts (experts/remote/placement.py `Placement`) and compute what rank 0 sends until it
says stop."""

from __future__ import annotations

import datetime
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from moepager.checkpoints.default import default_model_path
from moepager.checkpoints.gguf_read import resolve_model_path
from moepager.config import EngineConfig
from moepager.errors import MoepagerError
from moepager.experts.remote.placement import Links
from moepager.experts.remote.protocol import SHADOW_RANK, STATS, Stop, send
from moepager.loading.build import read_config
from moepager.models.registry import tensor_specs
from moepager.placements.remote import expert_worker, placement
from moepager.runtime.shadow import Shadow


def launch(config: EngineConfig, main: Callable[[EngineConfig, Links], int]) -> int:
    """In each process torchrun started: rank 0 returns `main(config, links)` with `config.remote.workers` set to the
    other ranks and `links` their process groups (experts/remote/placement.py `Links`), and tells them to stop when it
    is done (or fails); every other rank serves its experts. An error is one line naming the rank. Ctrl-C reaches every
    process of the terminal: only rank 0 takes it, and stops the others as when it is done."""
    if "RANK" not in os.environ:
        raise MoepagerError("worker processes are started by torchrun: `torchrun --nproc-per-node N -m "
                            "moepager.distributed generate ...` or `moepager generate --workers N-1 ...`")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=config.remote.worker_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2 + config.remote.shadow:
        dist.destroy_process_group()
        raise MoepagerError("torchrun started one process: give --nproc-per-node 2 or more (a main and workers)")
    links = Links.open(world, config.remote.worker_timeout_s, SHADOW_RANK if config.remote.shadow else None)
    if rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = replace(config, remote=replace(config.remote, workers=world - 1 - config.remote.shadow))
    if rank != 0:  # the workers and the shadow compute on the CPU (a main rank on CUDA: its layer calls go by host)
        config = replace(config, device="cpu")
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        if rank == 0:
            try:
                return main(config, links)
            finally:
                for rank_, stats in stop_workers(world, config.remote.worker_timeout_s, links).items():
                    shadow = config.remote.shadow and rank_ == SHADOW_RANK
                    print(describe_shadow(rank_, stats) if shadow else describe(rank_, stats), file=sys.stderr)
        path = resolve_model_path(config.model, tensor_specs) if config.model else default_model_path()
        if config.remote.shadow and rank == SHADOW_RANK:
            Shadow(config, path, placement(config, read_config(path)), links).serve()
        else:
            expert_worker(config, path, rank, links).serve()
        return 0
    except MoepagerError as e:  # a user's error, as a single process reports it: exit code 2
        print(f"error (rank {rank}): {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a worker whose main rank went away: nothing left to answer
        if rank == 0:
            raise
        print(f"error (rank {rank}): lost the main rank ({str(e).splitlines()[0]})", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()


def stop_workers(world: int, timeout_s: float, links: Links) -> dict[int, dict[str, float]]:
    """Every worker still there is told to stop and answers with its counters (`ExpertWorker.stats`); one already
    gone, or silent for `timeout_s`, is skipped (each on its own link: a silent one's timeout ends no other's)."""
    out = {}
    for rank in range(1, world):
        try:
            send(Stop(), [], rank, links.of(rank))
            stats = torch.empty(len(STATS), dtype=torch.float64)
            dist.irecv(stats, rank, group=links.of(rank)).wait(timeout=datetime.timedelta(seconds=timeout_s))
            out[rank] = dict(zip(STATS, stats.tolist()))
        except RuntimeError:
            pass
    return out


def describe(rank: int, stats: dict[str, float]) -> str:
    accesses = stats["hits"] + stats["misses"]
    ahead = f" ({stats['loads_ahead']:.0f} experts loaded ahead)" if stats["loads_ahead"] else ""
    if stats["forecast"]:
        ahead += f"; forecasts named {100 * stats['forecast'] / max(stats['routed'], 1):.1f}% of its routed experts"
    paged = f", hit rate {100 * stats['hits'] / accesses:.1f}%, {stats['bytes_disk'] / 2**20:.1f} MiB read from " \
        f"disk{ahead}" if accesses else " (its experts resident)"
    return f"worker rank {rank}: {stats['calls']:.0f} layer calls{paged}"


def describe_shadow(rank: int, stats: dict[str, float]) -> str:
    """The shadow's counters (runtime/shadow.py `Shadow.stats`) for people."""
    guessed = stats["hits"] + stats["misses"]
    ahead = f", {stats['loads_ahead']:.0f} run ahead on its own tokens ({100 * stats['hits'] / guessed:.1f}% of " \
        f"{guessed:.0f} guessed tokens right)" if stats["loads_ahead"] else ""
    aligned = f"; its KV cache realigned with the main rank's at {stats['aligned']:.0f} positions" \
        if stats["aligned"] else ""
    return f"shadow rank {rank}: {stats['calls']:.0f} passes computed as the main rank announced them{ahead}{aligned}"
