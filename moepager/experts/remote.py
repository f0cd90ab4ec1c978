"""Experts computed by worker processes over torch.distributed (OD-MoE's worker nodes; gloo on CPU).

Rank 0, the main rank, keeps the dense weights and the KV cache and runs the model; ranks 1..W are workers that hold
routed experts and compute them on demand. `Placement`: the workers form W // G groups of G consecutive ranks, MoE
layer i (in order) is served by group i mod (W // G) (round-robin by layer, as OD-MoE assigns layers), and expert e of
a layer lives on rank group[e mod G], so every expert lives on exactly one worker.

Per MoE layer call the main rank sends each worker of the layer's group that holds a routed expert a header (the
operation, the layer, the token count, the dtypes), then the layer's input and routing; the worker sorts the tokens by
expert exactly as the main rank does, computes its experts' rows with the same kernels as a single process
(`ArenaKernels.batch`), and sends them back in sorted order; the main rank places them among the layer's rows and
sums every token's rows in ascending expert order. So the output is the single-process run's bit for bit at the same
thread count. Every answer is awaited with a timeout: a worker that died (its connection drops) or stopped answering
is named in a `WorkerLost` error, and nothing hangs.

Each worker talks to the main rank (and a shadow rank's forecasts) on a process group of its own (`Links.open`):
gloo ends every connection of a group in which an operation timed out, so a worker that stops answering takes its
own link down and no other, and a failover run goes on without it.
"""

from __future__ import annotations

import datetime
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist

from moepager.config import WorkerLoss
from moepager.errors import MoepagerError, Unavailable
from moepager.experts.executor import ArenaKernels, PagedExecutor, combine, fused_takes
from moepager.experts.protocols import FusedKernel
from moepager.experts.sorting import SortedTokens, sort_by_expert
from moepager.experts.weights import ExpertShape
from moepager.policies.prefetch import PrefetchAware
from moepager.types import PassInfo, RoutingDecision, run_on_host

RUN, STOP, PLACE, PREFETCH = 1, 0, 2, 3
STATS = ("calls", "hits", "misses", "bytes_disk", "loads_ahead", "forecast", "routed")
"""What a worker answers a stop with (`ExpertWorker.stats`). `forecast`: the routed experts some forecast for their
pass had named (a shadow's or the main rank's predictor's), of `routed`, every expert the worker computed."""
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEADER = 7
"""op, then up to five fields (RUN: layer position, tokens, top-k, x's dtype, the weights' dtype), then the main
rank's pass (forecasts and layer calls of one pass go together)."""


SHADOW_RANK = 1
"""The shadow rank's place in a --shadow run (runtime/shadow.py): rank 0 is the main rank, the workers follow it."""

WAIT_FOR_WORK = datetime.timedelta(days=365)
"""How long a worker (or the shadow) waits for the main rank's next message: as long as the main rank is there (a
server may sit idle for hours; --worker-timeout bounds the waits inside a layer call). A main rank that is gone ends
the wait at once (gloo: "Connection closed by peer")."""


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


def message(op: int, *fields: int, pass_id: int = 0) -> torch.Tensor:
    """A header: `op`, its fields, zeros up to HEADER - 1, the pass."""
    return torch.tensor([op, *fields] + [0] * (HEADER - 2 - len(fields)) + [pass_id])


def send_placement(placement: Placement, rank: int, group: dist.ProcessGroup | None,
                   timeout: datetime.timedelta) -> None:
    """`PLACE`: the workers left (their count, then the group size) and their ranks, to `rank` on `group`, each send
    taken within `timeout`."""
    for t in (message(PLACE, len(placement.ranks), placement.group_size), torch.tensor(placement.ranks)):
        dist.isend(t, rank, group=group).wait(timeout=timeout)


def recv_placement(workers: int, group_size: int, group: dist.ProcessGroup | None = None) -> Placement:
    """The ranks after a `PLACE` header (its count and group size) from the main rank."""
    ranks = torch.empty(workers, dtype=torch.long)
    dist.recv(ranks, 0, group=group)
    return Placement(tuple(ranks.tolist()), group_size)


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


def _words(error: str, limit: int) -> str:
    """gloo's message, its first line without the source location, cut at a word within `limit` characters."""
    text = error.splitlines()[0].split("] ")[-1] if error else ""
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


class _Lost(Exception):
    def __init__(self, reasons: dict[int, str], silent: set[int]):
        super().__init__(reasons)
        self.reasons = reasons
        """Each lost worker's rank -> what happened."""
        self.silent = silent
        """Those that timed out (alive, but not answering)."""


def _timed_out(e: RuntimeError) -> bool:
    return "timed out" in str(e).lower()


class RemoteExecutor:
    """The main rank's executor: each layer's routed experts computed by the workers that hold them. A worker lost
    (`WorkerLost`) stops the run, or with `on_loss="failover"` a worker that died or stopped answering has its experts
    go to the workers left (a `PLACE` message: they load them) and the layer call is made again, so no token is lost or
    computed twice. (A silent worker can be left behind because it has a link of its own, `Links.open`: its timeout
    closes that group only.)"""

    def __init__(self, shape: ExpertShape, moe_layers: Sequence[int], num_experts: int, placement: Placement,
                 fused: FusedKernel | None, timeout_s: float, on_loss: WorkerLoss = "stop",
                 also_placed: Sequence[int] = (), links: Links = Links()):
        self.shape, self.placement, self.fused, self.links = shape, placement, fused, links
        self.also_placed = tuple(also_placed)
        """Ranks besides the workers told of a new placement, on the default group (a shadow rank: its forecasts)."""
        self.position = {layer: i for i, layer in enumerate(moe_layers)}
        self.num_experts = num_experts
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.on_loss = on_loss
        self.lost: list[int] = []
        """Workers lost and failed over, in order."""
        self.pass_id = 0
        self.compute_note = (fused.note + ", " if fused is not None else "") + \
            f"on {placement.workers} worker processes"
        self.store = None

    def run(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        """The layer's routed experts computed by the workers (a main rank on CUDA: over host copies, gloo's)."""
        return run_on_host(lambda x, r: self._run(layer, x, r), x_ND, route)

    def _run(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        work = sort_by_expert(x_ND, route)
        while True:
            try:
                return self._call(layer, x_ND, route, work)
            except _Lost as lost:
                if self.on_loss != "failover":
                    raise WorkerLost(next(iter(lost.reasons.values()))) from None
                self._failover(lost)

    def _call(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision, work: SortedTokens) -> torch.Tensor:
        n, k = route.ids_TK.shape
        position, placement = self.position[layer], self.placement
        by_rank: dict[int, list[int]] = {}
        for i, e in enumerate(work.experts):
            by_rank.setdefault(placement.rank(position, e), []).append(i)
        x = x_ND.contiguous()
        ids, weights = route.ids_TK.contiguous(), route.weights_TK.contiguous()
        header = message(RUN, position, n, k, DTYPES.index(x.dtype), DTYPES.index(weights.dtype), pass_id=self.pass_id)
        lost: dict[int, str] = {}
        silent: set[int] = set()
        for rank in by_rank:  # every worker starts before any answer is awaited: they compute at the same time
            try:
                for t in (header, x, ids, weights):
                    dist.send(t, rank, group=self.links.of(rank))
            except RuntimeError as e:
                lost[rank] = self._reason(rank, layer, e)
        weighted = fused_takes(self.fused, n)  # the workers' batches decide alike
        y_MD = torch.empty(work.x_MD.shape, dtype=torch.float32 if weighted else x.dtype)
        # every answer's receive is posted before any is awaited: a worker's send completes once its receive is
        # posted, so awaiting a silent worker first would leave the healthy ones' sends to time out too (and with
        # failover the run then lost them all)
        answers = []
        for rank, which in by_rank.items():
            if rank in lost:
                continue
            index = work.rows_of(which)
            rows = torch.empty(len(index), x.shape[1], dtype=y_MD.dtype)
            try:
                answers.append((rank, index, rows, dist.irecv(rows, rank, group=self.links.of(rank))))
            except RuntimeError as e:
                lost[rank] = self._reason(rank, layer, e)
        for rank, index, rows, received in answers:
            try:  # every answer is taken, even after a loss: the workers' streams stay in step
                received.wait(timeout=self.timeout)
            except RuntimeError as e:
                lost[rank] = self._reason(rank, layer, e)
                if _timed_out(e):
                    silent.add(rank)
                continue
            y_MD[index] = rows
        if lost:
            raise _Lost(lost, silent)
        if weighted:
            assert self.fused is not None
            return self.fused.combine(y_MD, work.token_M, n)
        return combine(x_ND, work, y_MD)

    def _reason(self, rank: int, layer: int, e: RuntimeError) -> str:
        if _timed_out(e):
            return (f"worker rank {rank} did not answer for MoE layer {layer} within "
                    f"{self.timeout.total_seconds():g} s (--worker-timeout)")
        where = f"while MoE layer {layer} waited for it" if layer >= 0 else "while it was given a new placement"
        return f"worker rank {rank} is gone: its connection dropped {where} ({_words(str(e), 120)})"

    def _failover(self, lost: _Lost) -> None:
        """The lost workers' experts to the workers left: each is told the new placement (and loads what it now
        holds before it answers the next call)."""
        reasons = lost.reasons
        if lost.silent and not self.links.groups:  # on the default group a timeout closed every connection
            raise WorkerLost(f"{reasons[min(lost.silent)]}; a timeout ends gloo's process group, and this run's "
                             "workers have no links of their own (experts/remote.py Links.open): it cannot fail over")
        try:
            placement = self.placement.without(set(reasons))
        except WorkerLost:  # name every worker lost in the run, not only this call's
            ranks = ", ".join(map(str, sorted({*self.lost, *reasons})))
            raise WorkerLost(f"every worker is lost (ranks {ranks}): {next(iter(reasons.values()))}") from None
        for rank in placement.ranks:
            try:
                send_placement(placement, rank, self.links.of(rank), self.timeout)
            except RuntimeError as e:  # lost as well: placed again without it at the next call
                reasons = {**reasons, rank: self._reason(rank, -1, e)}
        for rank in self.also_placed:  # (a shadow: its forecast to a silent worker may hold it up for one timeout)
            try:
                send_placement(placement, rank, None, 2 * self.timeout)
            except RuntimeError:
                pass  # gone: the run goes on without its forecasts
        self.placement = placement
        self.lost += sorted(reasons)
        for reason in reasons.values():
            print(f"{reason}; failing over: its experts go to worker ranks {', '.join(map(str, placement.ranks))}",
                  file=sys.stderr)

    # -- the prefetcher's store (runtime/prefetch.py): forecasts become the workers' loads ahead ---------------------
    order = SimpleNamespace(priority=PrefetchAware.priority)
    """How the prefetcher ranks queued prefetches (the store's default prefetch policy's rule)."""

    def quota(self, layer: int) -> int:
        """At most this many of a layer's experts are queued ahead (each worker's store takes what fits)."""
        return self.num_experts

    def settle(self, layer: int, experts: Sequence[int]) -> None:
        """Nothing here: each worker judges its own prefetches when the layer reaches it."""

    def prefetches_in_flight(self) -> int:
        return 0

    def prefetch_ranked(self, wanted: Sequence[tuple[int, int]], limit: int) -> int:
        """Send each worker its share of the first `limit` (layer, expert) forecasts, best first, to load ahead
        (workers that page: `--worker-memory`); returns the loads asked for."""
        pairs = [(self.position[layer], e) for layer, e in list(wanted)[:limit]]
        send_forecasts(self.placement, pairs, self.pass_id, self.links.of)  # matched to this pass's calls, or later
        return len(pairs)

    def begin_pass(self, info: PassInfo) -> None:
        """The main rank's pass: the tag of its layer calls (a worker matches forecasts to them)."""
        self.pass_id = info.pass_id

    def close(self) -> None:
        """Nothing: the launcher stops the workers (distributed/roles.py)."""

    def stream(self, layer: int, experts: Sequence[int]):  # noqa: ANN201 - the reference's ExpertSource seam
        raise MoepagerError("experts on worker processes are not streamed to the main rank")


Holding = tuple[ArenaKernels | None, PagedExecutor | None]
"""A worker's experts: resident (kernels over its arena) or paged (an executor over its own store)."""


def send_forecasts(placement: Placement, pairs: Sequence[tuple[int, int]], pass_id: int,
                   group_of: Callable[[int], dist.ProcessGroup | None]) -> None:
    """(layer position, expert) forecasts to the workers that hold them, to load ahead (`PREFETCH`), each on its group
    (`Links.of` from the main rank, `Links.forecasts_of` from a shadow); a lost worker is skipped (the next layer call
    finds it). A send waits until the worker takes it: one that stopped answering holds the sender up for its group's
    timeout (`Links.open`) once, and fails at once after that."""
    by_rank: dict[int, list[tuple[int, int]]] = {}
    for position, e in pairs:
        by_rank.setdefault(placement.rank(position, e), []).append((position, e))
    for rank, mine in by_rank.items():
        try:
            dist.send(message(PREFETCH, len(mine), pass_id=pass_id), rank, group=group_of(rank))
            dist.send(torch.tensor(mine), rank, group=group_of(rank))
        except RuntimeError:
            pass


class ExpertWorker:
    """A worker rank: its experts held resident in one arena, or paged through an expert store of its own from the
    checkpoint on its disk (`--worker-memory`: OD-MoE's just-in-time loading, with a cache of that size); computed for
    whatever the main rank sends until it says stop, when it answers with its counters (`STATS`). A new placement
    (`PLACE`, after another worker was lost) makes it hold what the placement now gives it (`hold`)."""

    def __init__(self, rank: int, moe_layers: Sequence[int], num_experts: int, shape: ExpertShape,
                 placement: Placement, hold: Callable[[Sequence[tuple[int, int]]], Holding],
                 links: Links = Links(), shadow_rank: int | None = None):
        self.rank, self.moe_layers, self.num_experts, self.shape = rank, list(moe_layers), num_experts, shape
        self.group = links.of(rank)
        """Its link with the main rank (None: the default group)."""
        self.shadow = (shadow_rank, links.forecasts_of(rank)) if shadow_rank is not None else None
        """The shadow rank and the group its forecasts come on, if there is one."""
        self._lock = threading.Lock()
        """Held while the store or the forecasts change: the shadow's forecasts are taken on a thread of their own."""
        self.hold = hold
        self.calls, self._last = 0, -1
        self.forecasts: dict[tuple[int, int], set[int]] = {}
        """(pass, layer position) -> experts forecast for it, until the layer call of that pass comes."""
        self.forecast_hits, self.routed = 0, 0
        self.paged: PagedExecutor | None = None
        self._carried = torch.zeros(4, dtype=torch.float64)
        """The store counters (hits, misses, bytes read, loads ahead) of the stores earlier placements gave it."""
        self._place(placement)

    def _place(self, placement: Placement) -> None:
        owned = placement.owned(self.rank, len(self.moe_layers), self.num_experts)
        if self.paged is not None:
            self._carried += self._store_counts()
            self.paged.store.close()
        self.kernels, self.paged = self.hold(owned)
        self.row = {key: i for i, key in enumerate(owned)}

    def serve(self) -> int:
        """Answer layer calls until told to stop, then send the counters; returns the calls answered. Forecasts
        (`PREFETCH`) come from the main rank between its calls, and from a shadow rank on a thread of their own
        (`_take_forecasts`)."""
        d, group = self.shape.hidden, self.group
        header = torch.empty(HEADER, dtype=torch.long)
        forecasts = None
        if self.shadow is not None:
            forecasts = threading.Thread(target=self._take_forecasts, name="shadow-forecasts", daemon=True)
            forecasts.start()
        while True:
            dist.irecv(header, 0, group=group).wait(timeout=WAIT_FOR_WORK)
            op, a, n, k, x_code, w_code, pass_id = header.tolist()
            if op == STOP:
                with self._lock:
                    dist.send(self.stats(), 0, group=group)
                if forecasts is not None:  # a shadow told to stop first has stopped them (a lost one: never mind)
                    forecasts.join(timeout=1)
                return self.calls
            if op == PREFETCH:  # a: how many (layer position, expert) pairs follow
                self._take_forecast(a, 0, group, pass_id)
                continue
            if op == PLACE:  # a: how many workers are left, n: their group size
                placement = recv_placement(a, n, group)
                with self._lock:
                    self._place(placement)
                continue
            x = torch.empty(n, d, dtype=DTYPES[x_code])
            ids, weights = torch.empty(n, k, dtype=torch.long), torch.empty(n, k, dtype=DTYPES[w_code])
            for t in (x, ids, weights):
                dist.recv(t, 0, group=group)
            with self._lock, torch.inference_mode():
                rows = self.compute(a, x, ids, weights, pass_id)
            dist.send(rows, 0, group=group)
            self.calls += 1

    def _take_forecasts(self) -> None:
        """The shadow's forecasts, until it says stop or is gone."""
        assert self.shadow is not None
        shadow, group = self.shadow
        header = torch.empty(HEADER, dtype=torch.long)
        try:
            while True:
                dist.irecv(header, shadow, group=group).wait(timeout=WAIT_FOR_WORK)
                op, count, *_, pass_id = header.tolist()
                if op != PREFETCH:
                    return
                self._take_forecast(count, shadow, group, pass_id)
        except RuntimeError:  # the shadow is gone: layer calls go on without its forecasts
            return

    def _take_forecast(self, count: int, source: int, group: dist.ProcessGroup | None, pass_id: int) -> None:
        """The `count` (layer position, expert) pairs after a `PREFETCH` header from `source`, taken as a forecast."""
        pairs = torch.empty(count, 2, dtype=torch.long)
        dist.recv(pairs, source, group=group)
        with self._lock:
            self._forecast(pairs.tolist(), pass_id)

    def _forecast(self, pairs: list[list[int]], pass_id: int) -> None:
        """Experts forecast for a pass: remembered (to count how many it got right) and, paged, loaded ahead."""
        for p, e in pairs:
            self.forecasts.setdefault((pass_id, p), set()).add(e)
        if self.paged is not None:
            self.paged.store.prefetch_ranked([(self.moe_layers[p], e) for p, e in pairs], len(pairs))

    def compute(self, position: int, x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor,
                pass_id: int = 0) -> torch.Tensor:
        """This worker's experts' rows of the layer, in the main rank's sorted order."""
        work = sort_by_expert(x_ND, RoutingDecision(ids_NK, weights_NK, weights_NK, ids_NK))
        which = [i for i, e in enumerate(work.experts) if (position, e) in self.row]
        named: set[int] = set()
        for key in [key for key in self.forecasts if key[1] == position and key[0] <= pass_id]:
            named |= self.forecasts.pop(key)  # every forecast for this layer up to this pass
        self.forecast_hits += sum(work.experts[i] in named for i in which)
        self.routed += len(which)
        if self.paged is not None:
            store = self.paged.store
            if position <= self._last:  # a new forward pass: the clock the store's policy ranks by
                store.clock += 1
            store.counters.set_phase("decode" if x_ND.shape[0] == 1 else "prefill")
            store.settle(self.moe_layers[position], [work.experts[i] for i in which])  # judge its prefetches
            batch = self.paged.kernels.batch(work, x_ND)
            self.paged.through_store(self.moe_layers[position], work, which, batch)
        else:
            assert self.kernels is not None
            rows = [self.row.get((position, e), -1) for e in work.experts]
            batch = self.kernels.batch(work, x_ND)
            batch.some(work, rows, which, batch.y_MD)
        self._last = position
        return batch.y_MD.index_select(0, work.rows_of(which)).contiguous()

    def stats(self) -> torch.Tensor:
        """`STATS`: calls, the store's counters (none when resident), forecast hits, routed experts."""
        return torch.cat([torch.tensor([float(self.calls)], dtype=torch.float64), self._carried + self._store_counts(),
                          torch.tensor([self.forecast_hits, self.routed], dtype=torch.float64)])

    def _store_counts(self) -> torch.Tensor:
        """This placement's store: hits, misses, bytes read from disk, loads ahead (zeros when resident)."""
        if self.paged is None:
            return torch.zeros(4, dtype=torch.float64)
        phases = self.paged.store.counters.phases.values()
        return torch.tensor([sum(sum(p.hits.values()) for p in phases), sum(sum(p.misses.values()) for p in phases),
                             sum(p.bytes_disk for p in phases), sum(p.loads_ahead for p in phases)],
                            dtype=torch.float64)
