"""The engine's own step order, for the simulator: a trace's requests laid out in the forward passes the engine would
run them in (`moepager simulate --order engine`).

The engine's scheduler (runtime/scheduler.py, FIFO or expertflow) runs over stand-ins of the requests (their token
counts, no model): requests join `concurrency` at a time and the next as one finishes (as `LLM.replay(...,
concurrency=N)` feeds the engine), prompts are chunked under the token budget beside running decodes, each step is
split into passes as the runner splits it (`pass_groups`), a request samples a token when its tokens are all computed
and finishes after `max_tokens` of them, and expertflow groups requests by the trace's own routing of their last
computed token (what the engine's path tracker sees when it replays that routing). So a replay at the same
scheduler configuration and concurrency runs the same passes over the same tokens (tests/trace/test_agreement.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moepager.config import SchedulerConfig
from moepager.runtime.batch_policy import batch_policy, needs_paths
from moepager.runtime.grouping import path_of
from moepager.runtime.kv_pool import KVBlocks
from moepager.runtime.request import QueuedRequest
from moepager.runtime.runner import pass_groups
from moepager.runtime.scheduler import Scheduler
from moepager.trace.format import DECODE, PREFILL, TraceError
from moepager.trace.workload import Workload


@dataclass
class _Stats:
    preemptions: int = 0


@dataclass
class _Request:
    """What the scheduler reads of a request, for one of the trace's."""

    request_id: int
    prompt_ids: list[int]
    max_tokens: int
    first: int
    """Its first token's index in the workload."""
    out_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    stats: _Stats = field(default_factory=_Stats)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.out_ids)

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed

    def tokens(self, start: int, count: int) -> list[int]:
        """(Placeholders: the simulator computes no tokens, it lays out the trace's.)"""
        return [0] * max(0, min(count, self.num_tokens - start))


class _TracePaths:
    """The path tracker's view for the scheduler, from the trace's routing of each request's last computed token."""

    def __init__(self, work: Workload):
        self.work = work
        h = work.header
        self.column = {layer: i for i, layer in enumerate(h.moe_layers)}
        self.num_experts = h.num_experts
        self.paths: dict[int, np.ndarray] = {}

    def saw(self, request: int, token: int) -> None:
        self.paths[request] = path_of(self.work.ids_NLK[token], self.num_experts)

    def path(self, request: int) -> np.ndarray | None:
        return self.paths.get(request)

    def update(self, decoding: Sequence[QueuedRequest]) -> None:
        """The trace's paths are the last computed token's (`saw`): nothing to forecast."""

    def forget(self, request: int) -> None:
        self.paths.pop(request, None)


def engine_steps(work: Workload, config: SchedulerConfig, concurrency: int) -> Workload:
    """`work` (each request's prompt tokens, then one token per decode step, as `Cut(prompt_tokens)` lays them)
    re-laid as the engine's passes at `config` with `concurrency` requests at a time (module note)."""
    if concurrency < 1:
        raise TraceError(f"concurrency must be at least 1, got {concurrency}")
    starts = np.concatenate([[0], np.cumsum(np.bincount(work.request_N))]).astype(int)
    requests = []
    for r in range(len(starts) - 1):
        phases = work.phase_N[starts[r]:starts[r + 1]]
        prompt = int((phases == PREFILL).sum())
        if prompt == 0:
            raise TraceError(f"request {work.names[r]} has no prompt tokens: cut the trace with a prompt length")
        requests.append(_Request(r, [0] * prompt, int(starts[r + 1] - starts[r]) - prompt + 1, int(starts[r])))
    paths = _TracePaths(work) if needs_paths(config) else None
    scheduler = Scheduler(config, KVBlocks(config.kv_cache_tokens, config.block_size), batch_policy(config, paths))
    pending = list(reversed(requests))
    inbox = [pending.pop() for _ in range(min(concurrency, len(pending)))]
    steps: list[np.ndarray] = []
    phases: list[int] = []
    while inbox or scheduler.running or scheduler.waiting:
        for request in inbox:
            scheduler.add(request)
        inbox = []
        rows = scheduler.schedule()
        if not rows:
            raise TraceError("the scheduler scheduled nothing: the KV cache cannot hold one request (raise "
                             "--kv-cache-tokens)")
        finished = []
        for group in pass_groups(rows, config.batch_invariant):
            tokens = []
            for row in group:
                request = requests[row.request.request_id]
                tokens.append(np.arange(row.start, row.start + row.count) + request.first)
                request.num_computed = row.start + row.count
                if paths is not None:
                    paths.saw(request.request_id, int(tokens[-1][-1]))
            steps.append(np.concatenate(tokens))
            phases.append(PREFILL if any(not row.decoding for row in group) else DECODE)
            for row in group:
                if row.completes:
                    request = requests[row.request.request_id]
                    request.out_ids.append(0)
                    if len(request.out_ids) >= request.max_tokens:
                        finished.append(request)
        for request in finished:
            scheduler.finish(request)
            if pending:
                inbox.append(pending.pop())
    ptr = np.concatenate([[0], np.cumsum([len(s) for s in steps])]).astype(np.int64)
    return Workload(work.header, work.ids_NLK, work.phase_N, work.request_N, np.concatenate(steps).astype(np.int64),
                    ptr, np.array(phases, np.uint8), work.names)
