"""Store counters: interval unions in bounded memory."""

from __future__ import annotations


def test_interval_union_stays_bounded_and_exact_for_a_long_running_server():
    from moepager.store.stats import IntervalUnion, union_s

    intervals = [(t * 0.5, t * 0.5 + 0.7) for t in range(20_000)] + [(20_000.0, 20_001.0), (20_000.5, 20_002.0)]
    grown = IntervalUnion(keep=256, horizon_s=60.0)
    for a, b in intervals:
        grown.add(a, b)
    assert len(grown.intervals) <= 256 + 1
    assert abs(grown.total_s - union_s(intervals)) < 1e-6


def test_interval_union_folds_rarely_when_nothing_is_old_enough():
    """Within the horizon nothing folds away: the fold must not then run again at every add."""
    from moepager.store import stats

    folds = 0
    union = stats.IntervalUnion(keep=64, horizon_s=1e9)
    fold = union._fold

    def counted() -> None:
        nonlocal folds
        folds += 1
        fold()
    union._fold = counted  # type: ignore[method-assign]
    for t in range(10_000):
        union.add(float(t), t + 0.5)  # disjoint: merging keeps them all
    assert folds <= 10 and abs(union.total_s - 5000.0) < 1e-6
