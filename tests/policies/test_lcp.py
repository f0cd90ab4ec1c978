"""LCP (MoEpic eq. 4): P = mu * rho^(nu / omega) mixes frequency with an exponential recency decay."""

from __future__ import annotations

import pytest

from moepager.policies.lcp import LCP
from moepager.types import ExpertKey

A, B = ExpertKey(0, 0), ExpertKey(0, 1)


def test_priority_formula_and_paper_defaults():
    lcp = LCP()
    assert (lcp.omega, lcp.rho) == (128.0, 0.25)
    for step in range(4):
        lcp.on_access([A], step)
    assert lcp.score(A, 3) == 4.0
    assert lcp.score(A, 3 + 128) == pytest.approx(1.0)  # idle 128 tokens: priority cut by 4x


def test_recency_beats_a_stale_higher_count():
    lcp = LCP()
    for step in range(8):
        lcp.on_access([A], step)  # mu = 8, last at step 7
    lcp.on_access([B], 300)  # mu = 1, fresh
    assert lcp.victim([A, B], 300) == A  # 8 * 0.25^(293/128) = 0.34 < 1
    soon = LCP()
    for step in range(8):
        soon.on_access([A], step)
    soon.on_access([B], 9)
    assert soon.victim([A, B], 10) == B  # soon after A's burst, frequency wins (7.7 > 1.0)


def test_never_activated_experts_go_first():
    lcp = LCP()
    lcp.on_access([A], 0)
    assert lcp.victim([A, ExpertKey(2, 5)], 1000) == ExpertKey(2, 5)
