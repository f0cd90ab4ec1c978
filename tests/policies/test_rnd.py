"""RND picks among the candidates only, reproducibly for a seed."""

from __future__ import annotations

from moepager.policies.rnd import RND
from moepager.types import ExpertKey


def test_random_victims_are_candidates_and_seeded():
    keys = [ExpertKey(0, e) for e in range(10)]
    a = [RND(seed=3).victim(keys, s) for s in range(3)]
    first, second = RND(seed=3), RND(seed=3)
    assert [first.victim(keys, 0) for _ in range(20)] == [second.victim(list(reversed(keys)), 0) for _ in range(20)]
    assert all(v in keys for v in a)
    assert len({RND(seed=s).victim(keys, 0) for s in range(30)}) > 3
