"""Which requests run in the next step, and how many of their tokens.

Algorithm (vLLM's, at our size): running requests first, oldest first, each taking what it needs (one token
when decoding, the rest of its prompt otherwise) within the step's token budget; a request whose next tokens
need a KV block the pool does not have preempts the youngest running request (its blocks freed, its tokens
recomputed when it runs again) until the block is found. Then waiting requests are admitted in arrival order
while the budget, the request limit and the pool allow, their prompts chunked to fit the budget. Batch-invariant
(SchedulerConfig.batch_invariant), a prompt is always chunked at the same places (`fixed_chunk`), whatever else runs:
a chunk that does not fit waits for the next step.

The batch policy (runtime/batch_policy/) says which decoding requests rest this step and how many requests may run
at once (`fifo`: none rest, max_num_seqs run; `expertflow`: two resident batches of similar routing decode in turns).
A resting request keeps its KV blocks.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from moepager.config import SchedulerConfig
from moepager.runtime.batch_policy import BatchPolicy, batch_policy
from moepager.runtime.kv_pool import KVBlocks
from moepager.runtime.request import QueuedRequest, SchedulableRequest


class Scheduled(NamedTuple):
    """`count` tokens of `request` from its position `start` on."""

    request: SchedulableRequest
    start: int
    count: int
    decoding: bool
    """A decode row: the request's last output token (otherwise prompt tokens, or tokens computed again)."""

    @property
    def completes(self) -> bool:
        """After this step every token of the request is in the cache, so its next token is sampled."""
        return self.start + self.count == self.request.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: KVBlocks, policy: BatchPolicy | None = None):
        """`policy`: the batch policy (default: the one `config.batch_policy` names, over no routing paths)."""
        self.config, self.pool = config, pool
        self.policy = policy if policy is not None else batch_policy(config)
        self.max_running = config.max_num_seqs * self.policy.running_factor
        self.fixed_chunk = max(1, config.max_batched_tokens - config.max_num_seqs + 1) if config.batch_invariant \
            else 0
        """Batch-invariant: every prompt chunk's size (room for it beside a decode row of every other request the
        step takes); 0 otherwise, when a chunk is whatever the budget leaves."""
        self.waiting: deque[QueuedRequest] = deque()
        self.running: list[QueuedRequest] = []
        self.preemptions = 0

    def add(self, request: QueuedRequest) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[Scheduled]:
        budget, rows, i = self.config.max_batched_tokens, [], 0
        resting = self.policy.resting(self.running) if self.policy.rests else ()
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if resting and request.request_id in resting:  # its turn is the next step
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

    def _fixed(self, remaining: int, budget: int) -> int | None:
        """Batch-invariant: the request's next fixed chunk, or none this step (so its prompt is split at the same
        places whatever else runs). Off, the step loops take min(remaining, budget) inline: no call per row."""
        chunk = min(remaining, self.fixed_chunk)
        return chunk if chunk <= budget else None

    def _preempt(self, request: QueuedRequest) -> None:
        self.pool.release(request.blocks)
        request.num_computed = 0
        request.stats.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: QueuedRequest) -> None:
        """Take a finished (or aborted) request out, wherever it is, and free its blocks (the policy forgets it)."""
        self.policy.forget(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.release(request.blocks)

    def close(self) -> None:
        """The batch policy's thread, if it has one, stops."""
        self.policy.close()
