"""Which requests run in the next step, and how many of their tokens.

Algorithm (vLLM's, at our size): running requests first, oldest first, each taking what it needs (one token
when decoding, the rest of its prompt otherwise) within the step's token budget; a request whose next tokens
need a KV block the pool does not have preempts the youngest running request (its blocks freed, its tokens
recomputed when it runs again) until the block is found. Then waiting requests are admitted in arrival order
while the budget, the request limit and the pool allow, their prompts chunked to fit the budget. Batch-invariant
(SchedulerConfig.batch_invariant), a prompt is always chunked at the same places (`fixed_chunk`), whatever else runs:
a chunk that does not fit waits for the next step.

Batch policy `expertflow` (ExpertFlow's token scheduler, runtime/grouping.py): up to twice `max_num_seqs` requests run.
When more requests are decoding than `max_num_seqs`, they are split into two groups of similar routing paths
(balanced 2-means over each request's last routed token) that decode in turns: the first group this step, the second
the next (with any request that started decoding in between), then the groups are formed again. The dual-batch
pipeline (ExpertFlow §4.2): the next pair's groups are formed on a thread of their own while the second group's step
computes, from the paths known when that step was scheduled (the first group's latest, the second's previous token);
at the next pair they are used with the finished requests dropped and new ones added to the smaller group. Prompt
chunks are
scheduled as in FIFO. A decoding request therefore sits out at most one step in a row (`WAIT_BOUND`) unless it is
preempted. A request's KV blocks stay in its block table whichever group it is in.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from moepager.config import SchedulerConfig
from moepager.runtime.grouping import PathTracker, balanced_two_means
from moepager.runtime.kv_pool import KVBlocks
from moepager.runtime.request import Request

WAIT_BOUND = 1
"""`expertflow`: the most steps in a row a decoding request sits out (unless preempted)."""


class Scheduled(NamedTuple):
    """`count` tokens of `request` from its position `start` on."""

    request: Request
    start: int
    count: int
    decoding: bool
    """A decode row: the request's last output token (otherwise prompt tokens, or tokens computed again)."""

    @property
    def completes(self) -> bool:
        """After this step every token of the request is in the cache, so its next token is sampled."""
        return self.start + self.count == self.request.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: KVBlocks, paths: PathTracker | None = None):
        self.config, self.pool = config, pool
        self.paths = paths
        """`expertflow`: each request's routing path (None for fifo)."""
        self.max_running = config.max_num_seqs * (2 if config.batch_policy == "expertflow" else 1)
        if config.batch_policy == "expertflow" and paths is None:
            raise ValueError("the expertflow batch policy groups requests by their routing paths: give a PathTracker")
        self._pair: set[int] = set()
        """`expertflow`: the decoding requests the current pair of steps grouped."""
        self._second: set[int] = set()
        """`expertflow`: the group that decodes next step (empty: the next step forms new groups)."""
        self._next: Future[tuple[set[int], set[int]]] | None = None
        """`expertflow`: the next pair's groups, formed on `_pool`'s thread while the pair's second step computes."""
        self._pool = ThreadPoolExecutor(1, "moepager-token-scheduler") if paths is not None else None
        self.fixed_chunk = max(1, config.max_batched_tokens - config.max_num_seqs + 1) if config.batch_invariant \
            else 0
        """Batch-invariant: every prompt chunk's size (room for it beside a decode row of every other request the
        step takes); 0 otherwise, when a chunk is whatever the budget leaves."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[Scheduled]:
        budget, rows, i = self.config.max_batched_tokens, [], 0
        resting = self._resting() if self.paths is not None else ()
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if resting and request.request_id in resting:  # expertflow: its group's turn is the next step
                i += 1
                continue
            remaining = request.remaining
            count = min(remaining, budget) if not self.fixed_chunk else self._fixed(remaining, budget)
            if count is None:  # batch-invariant: its fixed chunk does not fit beside the rows before it
                i += 1
                continue
            if not self.pool.reserve(request.blocks, request.num_computed + count):
                victim = self.running.pop()  # the youngest; never one already scheduled (those sit before i)
                self._preempt(victim)
                continue
            rows.append(Scheduled(request, request.num_computed, count, remaining == 1 and bool(request.out_ids)))
            budget -= count
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            request = self.waiting[0]
            count = min(request.remaining, budget) if not self.fixed_chunk else self._fixed(request.remaining, budget)
            if count is None:
                break
            if not self.pool.reserve(request.blocks, request.num_computed + count):
                break
            self.running.append(self.waiting.popleft())
            rows.append(Scheduled(request, request.num_computed, count, False))  # it joins: its prompt (or all again)
            budget -= count
        return rows

    def _resting(self) -> set[int]:
        """`expertflow`: the decoding requests that sit this step out (see the module note)."""
        decoding = [r for r in self.running if r.out_ids and r.remaining == 1]
        ids = [r.request_id for r in decoding]
        if len(decoding) <= self.config.max_num_seqs:  # one step takes them all
            self._pair, self._second, self._next = set(), set(), None
            return set()
        if self._second:  # the pair's second step: its second group, and whoever started decoding since
            run = (self._second & set(ids)) | (set(ids) - self._pair)
            self._pair, self._second = set(), set()
            self._next = self._pool.submit(self._groups, ids, self._snapshot(ids))  # the dual-batch pipeline
            return set(ids) - run
        groups = self._next.result() if self._next is not None else None
        self._next = None
        second = self._fitted(groups, ids) if groups is not None else None
        if second is None:
            second = self._groups(ids, self._snapshot(ids))[1]
        self._pair, self._second = set(ids), second
        return set(second)

    def _snapshot(self, ids: list[int]) -> np.ndarray:
        """The requests' paths as they are now (a request that has not routed yet: an empty path)."""
        assert self.paths is not None
        width = len(self.paths.column) * self.paths.num_experts
        return np.stack([p if (p := self.paths.path(i)) is not None else np.zeros(width, bool) for i in ids])

    @staticmethod
    def _groups(ids: list[int], paths: np.ndarray) -> tuple[set[int], set[int]]:
        first, second = balanced_two_means(paths)
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

    def _fixed(self, remaining: int, budget: int) -> int | None:
        """Batch-invariant: the request's next fixed chunk, or none this step (so its prompt is split at the same
        places whatever else runs). Off, the step loops take min(remaining, budget) inline: no call per row."""
        chunk = min(remaining, self.fixed_chunk)
        return chunk if chunk <= budget else None

    def _preempt(self, request: Request) -> None:
        self.pool.release(request.blocks)
        request.num_computed = 0
        request.stats.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Take a finished (or aborted) request out, wherever it is, and free its blocks (and forget its path)."""
        if self.paths is not None:
            self.paths.forget(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.release(request.blocks)
