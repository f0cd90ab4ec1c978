"""The batch policy `expertflow`: ExpertFlow's token scheduler (§3.3.3, §4.2).

Up to twice `max_num_seqs` requests run. When more requests are decoding than `max_num_seqs`, they are split into two
groups of similar routing paths (balanced 2-means over each request's path, then swaps: runtime/grouping.py) that decode
in turns: the first group this step, the second the next (with any request that started decoding in between), then the
groups are formed again. The dual-batch pipeline (§4.2): the next pair's groups are formed on a thread of the policy's
own while the second group's step computes, from the paths known when that step was scheduled (the first group's latest,
the second's previous token); at the next pair they are used with the finished requests dropped and new ones added to
the smaller group. A decoding request therefore sits out at most one step in a row (`WAIT_BOUND`) unless it is
preempted. Prompt chunks are scheduled as under FIFO.

A request's path (`PathTracker`) is its next token's expected routing. With `--predictor path` (ExpertFlow's own
path predictor, the paper's) it is forecast from that token, which is known once the last pass sampled it, when the
groups are formed; the pass reuses the forecast. With another `--predictor` that forecasts every MoE layer at the
next token (a fitted transition table does) it is that forecast, made in the last pass; else it is the request's last
token's routing (routing has token-to-token locality; the engine says so in one line). The path predictor's path
keeps its probabilities, and the groups are formed by 2-means followed by swaps that lower the expected distinct
experts (runtime/grouping.py `group`). What each source of paths saves on held-back requests of the real traces:
benchmarks/README.md `grouping`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np
import torch

from moepager.config import SchedulerConfig
from moepager.predictors.base import Forecast
from moepager.runtime.batch_policy.base import RoutingPaths
from moepager.runtime.grouping import group, path_of
from moepager.runtime.request import QueuedRequest
from moepager.types import PassInfo, RoutingDecision

Lookahead = Callable[[int, int, int], "torch.Tensor | None"]
"""(request id, position, token id) -> probs_LE of that token's routing, or None (`PathPredictor.lookahead`)."""

WAIT_BOUND = 1
"""The most steps in a row a decoding request sits out (unless preempted)."""


class ExpertFlowPolicy:
    running_factor = 2
    rests = True
    needs_paths = True

    def __init__(self, config: SchedulerConfig, paths: RoutingPaths | None):
        if paths is None:
            raise ValueError("the expertflow batch policy groups requests by their routing paths: give a PathTracker")
        self.max_num_seqs, self.paths = config.max_num_seqs, paths
        self._pair: set[int] = set()
        """The decoding requests the current pair of steps grouped."""
        self._second: set[int] = set()
        """The group that decodes next step (empty: the next step forms new groups)."""
        self._next: Future[tuple[set[int], set[int]]] | None = None
        """The next pair's groups, formed on `_pool`'s thread while the pair's second step computes."""
        self._pool: ThreadPoolExecutor | None = None
        """The dual-batch pipeline's thread (started by the first pair that needs it; `close` stops it)."""

    def _thread(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, "moepager-token-scheduler")
        return self._pool

    def resting(self, running: Sequence[QueuedRequest]) -> set[int]:
        """The decoding requests that sit this step out (see the module note)."""
        decoding = [r for r in running if r.out_ids and r.remaining == 1]
        ids = [r.request_id for r in decoding]
        if len(decoding) <= self.max_num_seqs:  # one step takes them all
            self._pair, self._second, self._next = set(), set(), None
            return set()
        if self._second:  # the pair's second step: its second group, and whoever started decoding since
            run = (self._second & set(ids)) | (set(ids) - self._pair)
            self._pair, self._second = set(), set()
            self.paths.update(decoding)
            self._next = self._thread().submit(self._groups, ids, self._snapshot(ids))  # the dual-batch pipeline
            return set(ids) - run
        groups = self._next.result() if self._next is not None else None
        self._next = None
        second = self._fitted(groups, ids) if groups is not None else None
        if second is None:
            self.paths.update(decoding)
            second = self._groups(ids, self._snapshot(ids))[1]
        self._pair, self._second = set(ids), second
        return set(second)

    def _snapshot(self, ids: list[int]) -> np.ndarray:
        """The requests' paths as they are now (a request that has not routed yet: an empty path); bits, or
        probabilities where any is a forecast's (the bits then read as certain)."""
        width = len(self.paths.column) * self.paths.num_experts
        return np.stack([p if (p := self.paths.path(i)) is not None else np.zeros(width, bool) for i in ids])

    @staticmethod
    def _groups(ids: list[int], paths: np.ndarray) -> tuple[set[int], set[int]]:
        first, second = group(paths)
        return {ids[j] for j in first}, {ids[j] for j in second}

    @staticmethod
    def _fitted(groups: tuple[set[int], set[int]], ids: list[int]) -> set[int] | None:
        """The second group of the pair formed ahead, for the requests decoding now: the finished ones dropped and the
        new ones (oldest first) given to the smaller group; None when the groups came apart by more than one request
        (then they are formed again)."""
        now = set(ids)
        first, second = groups[0] & now, groups[1] & now
        for i in ids:
            if i not in first and i not in second:
                (first if len(first) <= len(second) else second).add(i)
        return second if abs(len(first) - len(second)) <= 1 and first and second else None

    def forget(self, request_id: int) -> None:
        self.paths.forget(request_id)

    def close(self) -> None:
        """The pipeline's thread stops (a pair being formed is finished first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool, self._next = None, None


class PathTracker:
    """Each running request's next token's expected routing over every MoE layer, as a path (a routing observer and
    a pass part: runtime/llm.py plugs it in when the engine's batch policy reads paths, `needs_paths`)."""

    def __init__(self, moe_layers: Sequence[int], num_experts: int,
                 forecast: Callable[[int, int], Forecast | None] | None = None, top_k: int = 0,
                 lookahead: Lookahead | None = None):
        """Where a request's path comes from, first that applies:
        - `lookahead(request, start, token_id)`: probs_LE of its next token from that token (ExpertFlow's path
          predictor, `--predictor path`), asked when the scheduler forms groups (`update`);
        - `forecast(position, 1)`: a predictor's forecast of each MoE position at the rows' next tokens, made in the
          pass (the run's `--predictor`, which observes each layer before this tracker does) when it has one for
          every position;
        - its last routed token's routing (routing has token-to-token locality).
        A forecast made in the pass gives its `top_k` experts at each layer as the path; the lookahead's path keeps its
        probabilities, which the grouping reads as such (runtime/grouping.py `group`)."""
        self.column = {layer: i for i, layer in enumerate(moe_layers)}
        self.num_experts = num_experts
        self.forecast, self.top_k, self.lookahead = forecast, top_k, lookahead
        self.paths: dict[int, np.ndarray] = {}
        """request id -> [L * E]: the experts its next token is expected to use, as bits (routed, or a forecast's top
        k), or as the lookahead's probabilities (float32)."""
        self.forecast_passes = 0
        """Passes whose paths came from the predictor's forecasts (the rest: from the routing)."""
        self.lookahead_paths = 0
        """Paths the lookahead gave (one per decoding request each time groups are formed)."""
        self.routed_passes = 0
        """Passes whose paths came from the routing."""
        self._info: PassInfo | None = None
        self._last_rows: np.ndarray | None = None
        self._pending: dict[int, np.ndarray] = {}
        self._forecast: np.ndarray | None = None

    def begin_pass(self, info: PassInfo) -> None:
        self._flush()
        self._info = info
        ends = np.cumsum(info.counts)
        self._last_rows = ends - 1  # MoE blocks see the valid tokens row-major: a row's last token ends its span

    def stage(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> Sequence[torch.Tensor]:
        return ()

    def routed(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision, staged: Sequence[torch.Tensor]) -> None:
        if self._last_rows is None or route.ids_host_TK is None:
            return
        column = self.column[layer]
        self._pending[column] = route.ids_host_TK.numpy()[self._last_rows]
        if self.forecast is not None and column == len(self.column) - 1:  # every layer observed: the next token's
            rows = self._last_rows.tolist()
            forecasts = [self.forecast(j, 1) for j in range(len(self.column))]
            self._forecast = np.stack([f.rows(rows).top(self.top_k).cpu().numpy() for f in forecasts], 1) \
                if all(f is not None for f in forecasts) else None  # type: ignore[union-attr]

    def _flush(self) -> None:
        info, pending = self._info, self._pending
        if info is None or len(pending) != len(self.column):
            self._pending = {}
            return
        ids_RLK = np.stack([pending[column] for column in range(len(self.column))], 1)
        if self._forecast is not None:
            ids_RLK = self._forecast
            self.forecast_passes += 1
        else:
            self.routed_passes += 1
        for row, request in enumerate(info.requests):
            self.paths[request] = path_of(ids_RLK[row], self.num_experts)
        self._pending, self._info, self._forecast = {}, None, None

    def update(self, decoding: Sequence[QueuedRequest]) -> None:
        """Groups are about to be formed over `decoding`: each one's path from the lookahead of its next token,
        where there is one."""
        self._flush()
        if self.lookahead is None:
            return
        for r in decoding:
            probs_LE = self.lookahead(r.request_id, r.num_computed, r.tokens(r.num_computed, 1)[0])
            if probs_LE is not None:
                self.paths[r.request_id] = probs_LE.reshape(-1).float().numpy()
                self.lookahead_paths += 1

    def path(self, request: int) -> np.ndarray | None:
        """The request's latest path, or None before it has routed."""
        self._flush()
        return self.paths.get(request)

    def forget(self, request: int) -> None:
        self._flush()  # its last pass first, so that nothing brings it back
        self.paths.pop(request, None)

    report_name = "token scheduler"

    def reset_report(self) -> None:
        self.lookahead_paths = self.forecast_passes = self.routed_passes = 0

    def report(self) -> PathsReport:
        return PathsReport(self.lookahead_paths, self.forecast_passes, self.routed_passes)


@dataclass(frozen=True)
class PathsReport:
    """The token scheduler's section of a call's statistics: where the paths it grouped by came from."""

    lookahead: int
    """Paths forecast from the next token when groups were formed (the path predictor's)."""
    forecast_passes: int
    """Passes whose rows' paths were a predictor's next-token forecast."""
    routed_passes: int
    """Passes whose rows' paths were their routing."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        return [("grouping paths", f"{self.lookahead} forecast from the next token (path predictor), "
                                   f"{self.forecast_passes} passes' next-token forecasts, "
                                   f"{self.routed_passes} passes' routing")]
