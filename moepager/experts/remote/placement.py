"""Where OD-MoE's experts live and how the ranks reach each other.

`Placement`: the workers form W // G groups of G consecutive ranks, and MoE layer i (in order) is served by group
i mod (W // G) (round-robin by layer, as OD-MoE assigns layers). Expert e's home is rank group[e mod G]. Which worker
computes a layer call's experts (`assign`):
- "one-to-one" (OD-MoE §2.3: the group's workers each take one of the layer's routed experts): the call's distinct
  experts, in ascending order, go to their home worker while it has fewer than ceil(n / G) of them, and the rest to
  the least loaded workers (the lowest rank of a tie). So no worker computes more than ceil(n / G) of a call's n
  experts, and at one token with G >= top-k no two share a worker; an expert leaves its home only when its home is
  taken, so a paging worker's cache keeps its locality. Every worker of the group can be asked for any of the layer's
  experts: a paging worker reads what it is asked for (`--worker-memory`), a resident one holds its group's layers
  whole (`holds`).
- "fixed": every expert on its home worker (each expert in one worker's RAM, G times less than one-to-one's); two of
  a call's experts with the same home wait on one worker (42.3% of Mixtral's decode calls at G = top-k = 2, audit
  2026-12-01).
Both sides compute the assignment from the call itself and its pass's phase (`ranks_of`), so nothing about it goes on
the wire. A prefill pass's calls (`prefill`):
- "spread" (OD-MoE §2.7, "worker i handles expert i of every layer"): expert e of any layer goes to worker e mod W of
  all W workers, so every worker computes in every layer of a prompt, where a decode call keeps to its layer's group
  of G. A prompt's tokens route to nearly every expert, so a layer's work is split W ways instead of G. Paging workers
  read what they are asked for; resident ones then also hold that share (`holds`). With W = G (one group) it is the
  group's own assignment: the same workers, and one-to-one balances a call where residues can collide
  (benchmarks/README.md#workers has the modeled cost of each).
- "group": as decode calls.

`Links`: each worker talks to the main rank (and a shadow rank's forecasts) on a process group of its own: gloo ends
every connection of a group in which an operation timed out, so a worker that stops answering takes its own link down
and no other, and a failover run goes on without it.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moepager.config import WORKER_ASSIGNS, WORKER_PREFILLS, WorkerAssign, WorkerPrefill
from moepager.errors import MoepagerError, Unavailable
from moepager.experts.remote.protocol import Place, send
from moepager.types import Phase


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
    """Which worker rank computes each (MoE layer position, expert) of a call (module note): `ranks` are the live
    workers."""

    ranks: tuple[int, ...]
    group_size: int
    assign: WorkerAssign = "one-to-one"
    prefill: WorkerPrefill = "group"
    """Who computes a prefill pass's calls (module note)."""

    def __post_init__(self) -> None:
        if not self.ranks or not 1 <= self.group_size <= len(self.ranks):
            raise MoepagerError(f"a worker group of {self.group_size} needs 1 to {len(self.ranks)} workers")
        if self.assign not in WORKER_ASSIGNS:
            raise MoepagerError(f"worker assignment '{self.assign}': choose {' or '.join(WORKER_ASSIGNS)}")
        if self.prefill not in WORKER_PREFILLS:
            raise MoepagerError(f"worker prefill '{self.prefill}': choose {' or '.join(WORKER_PREFILLS)}")

    @classmethod
    def of(cls, workers: int, group_size: int, assign: WorkerAssign = "one-to-one",
           prefill: WorkerPrefill = "group") -> Placement:
        """Workers 1..`workers`."""
        return cls(tuple(range(1, workers + 1)), group_size, assign, prefill)

    @property
    def workers(self) -> int:
        return len(self.ranks)

    @property
    def groups(self) -> int:
        return self.workers // self.group_size

    def group(self, position: int) -> tuple[int, ...]:
        """The ranks of the group that serves MoE layer `position`."""
        first = (position % self.groups) * self.group_size
        return self.ranks[first:first + self.group_size]

    def rank(self, position: int, expert: int) -> int:
        """Expert `expert`'s home worker."""
        return self.group(position)[expert % self.group_size]

    def share(self, n: int) -> int:
        """ceil(n / G): the most of a call's n experts one-to-one assignment gives a worker."""
        return -(-n // self.group_size)

    def spreads(self, phase: Phase) -> bool:
        """A pass of `phase` spreads its calls over every worker by residue (a spread prefill with more than one
        group; module note)."""
        return phase == "prefill" and self.prefill == "spread" and self.workers > self.group_size

    def ranks_of(self, position: int, experts: Sequence[int], phase: Phase = "decode") -> list[int]:
        """The worker that computes each of a layer call's distinct `experts` (ascending) in a pass of `phase`, by
        `assign`, or in a prefill pass by `prefill` (module note)."""
        if self.spreads(phase):
            return [self.ranks[e % self.workers] for e in experts]
        if self.assign == "fixed":
            return [self.rank(position, e) for e in experts]
        group, size = self.group(position), self.group_size
        cap = self.share(len(experts))
        load = [0] * size
        slot: list[int | None] = [None] * len(experts)
        for i, e in enumerate(experts):
            if load[home := e % size] < cap:
                slot[i], load[home] = home, load[home] + 1
        for i in range(len(experts)):
            if slot[i] is None:
                least = min(range(size), key=load.__getitem__)
                slot[i], load[least] = least, load[least] + 1
        return [group[j] for j in slot if j is not None]

    def owned(self, rank: int, num_layers: int, num_experts: int) -> list[tuple[int, int]]:
        """(layer position, expert) pairs whose home is `rank`, in order (the share a worker's --worker-memory is
        measured against)."""
        return [(p, e) for p in range(num_layers) for e in range(num_experts) if self.rank(p, e) == rank]

    def holds(self, rank: int, num_layers: int, num_experts: int) -> list[tuple[int, int]]:
        """(layer position, expert) pairs `rank` may be asked to compute, in order: its home share ("fixed"), or every
        expert of the layers its group serves ("one-to-one"); with spread prefill also expert e of every layer where
        e mod W is its place among the workers."""
        if self.assign == "fixed":
            decode = set(self.owned(rank, num_layers, num_experts))
        else:
            decode = {(p, e) for p in range(num_layers) if rank in self.group(p) for e in range(num_experts)}
        i, spread = self.ranks.index(rank), self.spreads("prefill")
        return [(p, e) for p in range(num_layers) for e in range(num_experts) if (p, e) in decode or (
            spread and e % self.workers == i)]

    def without(self, lost: set[int]) -> Placement:
        """The placement over the workers left (groups no larger than they are)."""
        ranks = tuple(r for r in self.ranks if r not in lost)
        if not ranks:
            raise WorkerLost(f"every worker is lost (ranks {', '.join(map(str, sorted(lost)))})")
        return Placement(ranks, min(self.group_size, len(ranks)), self.assign, self.prefill)


def send_placement(placement: Placement, rank: int, group: dist.ProcessGroup | None,
                   timeout: datetime.timedelta) -> None:
    """`Place`: the workers left (their count, group size and assignment, then their ranks), to `rank` on `group`,
    each send taken within `timeout`."""
    send(Place(len(placement.ranks), placement.group_size, WORKER_ASSIGNS.index(placement.assign),
               WORKER_PREFILLS.index(placement.prefill)),
         [torch.tensor(placement.ranks)], rank, group, timeout)


def recv_placement(message: Place, group: dist.ProcessGroup | None = None) -> Placement:
    """The ranks after a `Place` header from the main rank."""
    ranks = torch.empty(message.workers, dtype=torch.long)
    dist.recv(ranks, 0, group=group)
    return Placement(tuple(ranks.tolist()), message.group_size, WORKER_ASSIGNS[message.assign_code],
                     WORKER_PREFILLS[message.prefill_code])
