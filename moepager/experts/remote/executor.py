"""The main rank's executor of OD-MoE: each layer's routed experts computed by the workers that hold them.

Per MoE layer call the main rank sends each worker of the layer's group that holds a routed expert a `Run` header (the
layer, the token count, the dtypes, the pass and its phase), then the layer's input and routing; the worker sorts the
tokens by expert exactly as the main rank does, computes its experts' rows with the same kernels as a single process
(`ArenaKernels.batch`), and sends them back in sorted order; the main rank places them among the layer's rows and
sums every token's rows in ascending expert order. So the output is the single-process run's bit for bit at the same
thread count. Every answer is awaited with a timeout: a worker that died (its connection drops) or stopped answering
is named in a `WorkerLost` error, and nothing hangs.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Sequence
from functools import partial

import torch
import torch.distributed as dist

from moepager.config import WorkerLoss
from moepager.errors import MoepagerError
from moepager.experts.executor import combine, fused_takes
from moepager.experts.protocols import FusedKernel
from moepager.experts.remote.placement import Links, Placement, WorkerLost, send_placement
from moepager.experts.remote.protocol import Run, send_forecasts
from moepager.experts.sorting import SortedTokens, sort_by_expert
from moepager.experts.weights import ExpertShape
from moepager.store.view import Priority
from moepager.types import PassInfo, Phase, RoutingDecision, run_on_host


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
                 also_placed: Sequence[int] = (), links: Links = Links(), *, priority: Priority):
        self.shape, self.placement, self.fused, self.links = shape, placement, fused, links
        self.also_placed = tuple(also_placed)
        """Ranks besides the workers told of a new placement, on the default group (a shadow rank: its forecasts)."""
        self.position = {layer: i for i, layer in enumerate(moe_layers)}
        self.num_experts = num_experts
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.on_loss = on_loss
        self.lost: list[int] = []
        """Workers lost and failed over, in order."""
        self.calls, self.crowded = 0, 0
        """Layer calls made, and those in which one worker was given more than its share, ceil(n / G), of the call's
        n experts (none with one-to-one assignment; two that share a home worker with fixed); a spread prefill's calls
        are not judged (their experts go to workers by residue, OD-MoE's scheme)."""
        self.pass_id = 0
        self.phase: Phase = "prefill"
        """The main rank's pass and its phase (`begin_pass`): every layer call's header carries them."""
        self.priority = priority
        """How the prefetcher ranks queued forecasts (the builder's prefetch policy's rule; `StoreView`)."""
        self.compute_note = (fused.note + ", " if fused is not None else "") + \
            f"on {placement.workers} worker processes ({placement.assign} assignment, {placement.prefill} prefill)"
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
        for i, rank in enumerate(placement.ranks_of(position, work.experts, self.phase)):
            by_rank.setdefault(rank, []).append(i)
        self.calls += 1
        if not placement.spreads(self.phase):  # (a spread prefill's experts go by residue mod W)
            self.crowded += max(map(len, by_rank.values()), default=0) > placement.share(len(work.experts))
        x = x_ND.contiguous()
        ids, weights = route.ids_TK.contiguous(), route.weights_TK.contiguous()
        header = Run.of(position, x, weights, self.pass_id, self.phase).header()
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
                             "workers have no links of their own (experts/remote/placement.py Links.open): it cannot "
                             "fail over")
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

    # -- the prefetcher's store view (store/view.py `StoreView`): forecasts become the workers' loads ahead ----------
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
        # matched to this pass's calls or later
        send_forecasts(partial(self.placement.ranks_of, phase=self.phase), pairs, self.pass_id, self.links.of)
        return len(pairs)

    def begin_pass(self, info: PassInfo) -> None:
        """The main rank's pass: the tag of its layer calls (a worker's clock and phase; it matches forecasts to
        them)."""
        self.pass_id, self.phase = info.pass_id, info.phase

    def close(self) -> None:
        """Nothing: the launcher stops the workers (distributed/roles.py)."""

    def stream(self, layer: int, experts: Sequence[int]):  # noqa: ANN201 - the reference's ExpertSource seam
        raise MoepagerError("experts on worker processes are not streamed to the main rank")
