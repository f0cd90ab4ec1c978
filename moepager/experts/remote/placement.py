"""Where OD-MoE's experts live and how the ranks reach each other.

`Placement`: the workers form W // G groups of G consecutive ranks, MoE layer i (in order) is served by group
i mod (W // G) (round-robin by layer, as OD-MoE assigns layers), and expert e of a layer lives on rank group[e mod G],
so every expert lives on exactly one worker. `Links`: each worker talks to the main rank (and a shadow rank's
forecasts) on a process group of its own: gloo ends every connection of a group in which an operation timed out, so
a worker that stops answering takes its own link down and no other, and a failover run goes on without it.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moepager.errors import MoepagerError, Unavailable
from moepager.experts.remote.protocol import Place, send


@dataclass(frozen=True)
class Links:
    """The process groups each worker rank talks on: its link with the main rank, and its forecast link with a shadow
    rank if there is one (`open`); or the default group for all (`Links()`, where none were opened: then a worker that
    stops answering cannot be failed over, `RemoteExecutor._failover`)."""

    groups: Mapping[int, dist.ProcessGroup] = field(default_factory=dict)
    forecast_groups: Mapping[int, dist.ProcessGroup] = field(default_factory=dict)

    @classmethod
    def open(cls, world: int, timeout_s: float, shadow_rank: int | None = None) -> Links:
        """Two ranks to a group, operations timing out after `timeout_s` (--worker-timeout): each worker with the main
        rank, and with the shadow rank if there is one. Every rank calls it right after `init_process_group` (group
        creation is collective, in the same order everywhere).
        - Why a group per worker: probe, with gloo on this machine, 2026-11-28: after a receive from one rank timed out
          on the default group, a send to another rank failed ("Application timeout caused pair closure"); on groups
          of their own the other rank went on answering.
        - Why the shadow's forecasts have groups of their own (taken on a thread of the worker's): so that a worker
          receives from one rank on each group. A receive from any source (the main rank's calls or the shadow's
          forecasts) does not end when one of them is gone (probe, gloo, 2026-11-28: a receive from rank 0 failed
          at once when rank 0 exited, "Connection closed by peer"; a receive from any source waited on)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        groups, forecast_groups = {}, {}
        for rank in range(1, world):
            if rank != shadow_rank:
                groups[rank] = dist.new_group([0, rank], timeout=timeout)
                if shadow_rank is not None:
                    forecast_groups[rank] = dist.new_group(sorted([shadow_rank, rank]), timeout=timeout)
        return cls(groups, forecast_groups)

    def of(self, rank: int) -> dist.ProcessGroup | None:
        """The process group worker `rank` and the main rank talk on (None: the default group)."""
        return self.groups.get(rank)

    def forecasts_of(self, rank: int) -> dist.ProcessGroup | None:
        """The process group a shadow rank sends worker `rank` its forecasts on (None: the default group)."""
        return self.forecast_groups.get(rank)


class WorkerLost(Unavailable):
    """A worker rank died or did not answer in time (and the run cannot go on without it)."""


@dataclass(frozen=True)
class Placement:
    """Which worker rank holds each (MoE layer position, expert) (module note): `ranks` are the live workers."""

    ranks: tuple[int, ...]
    group_size: int

    def __post_init__(self) -> None:
        if not self.ranks or not 1 <= self.group_size <= len(self.ranks):
            raise MoepagerError(f"a worker group of {self.group_size} needs 1 to {len(self.ranks)} workers")

    @classmethod
    def of(cls, workers: int, group_size: int) -> Placement:
        """Workers 1..`workers`."""
        return cls(tuple(range(1, workers + 1)), group_size)

    @property
    def workers(self) -> int:
        return len(self.ranks)

    @property
    def groups(self) -> int:
        return self.workers // self.group_size

    def rank(self, position: int, expert: int) -> int:
        group = position % self.groups
        return self.ranks[group * self.group_size + expert % self.group_size]

    def owned(self, rank: int, num_layers: int, num_experts: int) -> list[tuple[int, int]]:
        """(layer position, expert) pairs `rank` holds, in order."""
        return [(p, e) for p in range(num_layers) for e in range(num_experts) if self.rank(p, e) == rank]

    def without(self, lost: set[int]) -> Placement:
        """The placement over the workers left (groups no larger than they are)."""
        ranks = tuple(r for r in self.ranks if r not in lost)
        if not ranks:
            raise WorkerLost(f"every worker is lost (ranks {', '.join(map(str, sorted(lost)))})")
        return Placement(ranks, min(self.group_size, len(ranks)))


def send_placement(placement: Placement, rank: int, group: dist.ProcessGroup | None,
                   timeout: datetime.timedelta) -> None:
    """`Place`: the workers left (their count and group size, then their ranks), to `rank` on `group`, each send
    taken within `timeout`."""
    send(Place(len(placement.ranks), placement.group_size), [torch.tensor(placement.ranks)], rank, group, timeout)


def recv_placement(message: Place, group: dist.ProcessGroup | None = None) -> Placement:
    """The ranks after a `Place` header from the main rank."""
    ranks = torch.empty(message.workers, dtype=torch.long)
    dist.recv(ranks, 0, group=group)
    return Placement(tuple(ranks.tolist()), message.group_size)
