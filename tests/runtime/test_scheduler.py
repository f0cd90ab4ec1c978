"""The scheduler alone, on fake requests and a fake block pool: decodes first, chunked prompts under the token
budget, the request limit, and preemption of the youngest when blocks run out (milliseconds, no model)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moepager.config import SchedulerConfig
from moepager.runtime.scheduler import Scheduler


@dataclass
class FakeStats:
    preemptions: int = 0


@dataclass
class FakeRequest:
    name: str
    prompt_ids: list[int]
    out_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    stats: FakeStats = field(default_factory=FakeStats)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.out_ids)

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def request_id(self) -> int:
        """(What a batch policy keys requests by: their names are unique here.)"""
        return hash(self.name)


class FakePool:
    """KVBlockPool's reserve/release over a plain free list."""

    def __init__(self, blocks: int, block_size: int = 4):
        self.free, self.block_size = list(range(blocks)), block_size

    def reserve(self, blocks: list[int], tokens: int) -> bool:
        need = math.ceil(tokens / self.block_size) - len(blocks)
        if need > len(self.free):
            return False
        blocks.extend(self.free.pop() for _ in range(max(need, 0)))
        return True

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))
        blocks.clear()


def step(scheduler: Scheduler) -> list[tuple[str, int, int, bool]]:
    """Schedule one step and run it: every scheduled token enters the cache; completed rows sample a token."""
    rows = scheduler.schedule()
    for row in rows:
        row.request.num_computed += row.count
        if row.completes:
            row.request.out_ids.append(0)
    return [(r.request.name, r.start, r.count, r.decoding) for r in rows]


def make(max_seqs: int = 4, budget: int = 8, blocks: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_batched_tokens=budget), FakePool(blocks))


def test_prompts_are_chunked_to_the_budget_and_decodes_go_first():
    s = make(budget=8)
    a, b = FakeRequest("a", [1] * 10), FakeRequest("b", [1] * 3)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 0, 8, False)]  # a's prompt fills the budget; b waits
    assert step(s) == [("a", 8, 2, False), ("b", 0, 3, False)]  # a's rest, then b joins within the budget
    assert step(s) == [("a", 10, 1, True), ("b", 3, 1, True)]  # both decode: one token each, oldest first


def test_the_request_limit_keeps_the_rest_waiting():
    s = make(max_seqs=2, budget=64)
    for name in "abc":
        s.add(FakeRequest(name, [1] * 2))
    assert [row[0] for row in step(s)] == ["a", "b"]
    assert [r.name for r in s.waiting] == ["c"]
    s.finish(s.running[0])  # a finishes: c takes its place next step
    assert [row[0] for row in step(s)] == ["b", "c"]


def test_a_preempted_request_goes_back_to_the_front_with_nothing_computed():
    s = make(max_seqs=4, budget=64, blocks=2)  # 8 positions
    a, b = FakeRequest("a", [1] * 4), FakeRequest("b", [1] * 4)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 0, 4, False), ("b", 0, 4, False)]  # both blocks taken
    # a's decode at position 4 needs a third block: b, the youngest, is preempted and a decodes in its place
    assert step(s) == [("a", 4, 1, True)]
    assert (b.num_computed, b.blocks, b.stats.preemptions, s.preemptions) == (0, [], 1, 1)
    assert list(s.waiting) == [b] and s.running == [a]
    s.finish(a)  # a ends: its blocks come back and b is recomputed from its first token
    assert step(s) == [("b", 0, 5, False)]


def test_finish_frees_a_waiting_or_running_request_and_its_blocks():
    pool = FakePool(4)
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_batched_tokens=64), pool)
    a, b = FakeRequest("a", [1] * 6), FakeRequest("b", [1] * 2)
    s.add(a)
    s.add(b)
    step(s)
    assert len(pool.free) == 2
    s.finish(b)  # waiting
    s.finish(a)  # running
    assert (s.running, list(s.waiting), len(pool.free)) == ([], [], 4)


def test_batch_invariant_prompts_are_chunked_at_the_same_places_whatever_runs_beside_them():
    config = SchedulerConfig(max_num_seqs=4, max_batched_tokens=12, batch_invariant=True)
    s = Scheduler(config, FakePool(64))
    assert s.fixed_chunk == 9  # room for three other requests' decodes beside a chunk
    a, b = FakeRequest("a", [1] * 20), FakeRequest("b", [1] * 5)
    s.add(a)
    s.add(b)
    assert step(s) == [("a", 0, 9, False)]  # b's 5 tokens would fit the 3 left, but not whole: it waits
    assert step(s) == [("a", 9, 9, False)]
    assert step(s) == [("a", 18, 2, False), ("b", 0, 5, False)]
    assert step(s) == [("a", 20, 1, True), ("b", 5, 1, True)]
    alone = Scheduler(config, FakePool(64))
    c = FakeRequest("c", [1] * 20)
    alone.add(c)
    assert [step(alone)[0][1:3] for _ in range(3)] == [(0, 9), (9, 9), (18, 2)]  # the same chunks alone
