"""The store's key space (store/keyspace.py): whole experts, or the parts of split ones, and the store's only knowledge
of split experts."""

from __future__ import annotations

import ast
import pathlib

import pytest

import moepager.store.store as store_module
from moepager.store.keyspace import WHOLE, PartKey, SplitParts
from moepager.types import ExpertKey
from tests.store.test_store import consume, make_store, value


def test_whole_experts_name_each_expert_once_and_cache_any():
    keys = [ExpertKey(3, e) for e in (5, 0, 7)]
    assert WHOLE.parts == 1 and not WHOLE.streaming and not WHOLE.buffered
    assert WHOLE.keys(3, 5) == [ExpertKey(3, 5)] and all(map(WHOLE.cacheable, keys))
    assert WHOLE.never_cached(keys, [0, 2]) == ([0, 2], [])
    assert WHOLE.runs(keys) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="split experts only"):
        WHOLE.with_tops({3: 1})


def test_split_parts_name_each_part_typed_and_cache_each_layers_top_parts():
    space = SplitParts(3, {0: 1, 1: 3})
    assert space.streaming == {0}  # layer 1 caches every part: nothing of it always streams
    for layer, e, j in ((0, 0, 0), (0, 4, 2), (1, 2, 1)):
        part = PartKey(layer, e, j)
        assert space.part(space.key(part)) == part and space.key(part) == ExpertKey(layer, 3 * e + j)
    assert space.keys(0, 2) == [ExpertKey(0, 6), ExpertKey(0, 7), ExpertKey(0, 8)]
    assert space.top_keys(0, 2) == [ExpertKey(0, 6)] and space.bottom_keys(0, 2) == [ExpertKey(0, 7), ExpertKey(0, 8)]
    assert space.top_keys(1, 2) == space.keys(1, 2) and space.bottom_keys(1, 2) == []
    assert [space.cacheable(ExpertKey(0, u)) for u in range(6)] == [True, False, False, True, False, False]
    assert all(space.cacheable(ExpertKey(1, u)) for u in range(6))
    keys = [ExpertKey(0, u) for u in (3, 4, 5, 9, 1)]
    assert space.never_cached(keys, [0, 1, 3, 4]) == ([0, 3], [1, 4])
    # consecutive parts of one expert load in one read; a new expert, a gap or another layer starts a run
    keys = [ExpertKey(0, 3), ExpertKey(0, 4), ExpertKey(0, 5), ExpertKey(0, 6), ExpertKey(0, 8), ExpertKey(1, 9)]
    assert space.runs(keys) == [[0, 1, 2], [3], [4], [5]]
    assert space.whole(0, {0, 3, 4, 7}) == {0, 1} and space.whole(1, {0, 1, 2, 3, 4}) == {0}
    moved = space.with_tops({0: 3, 1: 2})
    assert moved.parts == 3 and moved.tops == {0: 3, 1: 2} and moved.streaming == {1} and space.tops == {0: 1, 1: 3}


@pytest.mark.parametrize("parts, tops, why", [(1, {0: 1}, "2 or more parts"), (2, {0: 0}, r"1\.\.2"),
                                              (2, {0: 3}, r"1\.\.2")])
def test_a_split_key_space_refuses_what_it_cannot_name(parts, tops, why):
    with pytest.raises(ValueError, match=why):
        SplitParts(parts, tops)


def test_a_store_takes_split_parts_only_with_stream_rows_for_their_bottoms():
    store, _ = make_store(8, streams=0)
    with pytest.raises(ValueError, match="needs stream rows"):
        store.use(SplitParts(2, {0: 1, 1: 1}))
    store.use(SplitParts(2, {0: 2, 1: 2}))  # every part cached: nothing streams
    assert store.buffer is not None
    whole, _ = make_store(8)
    assert whole.buffer is None
    with pytest.raises(ValueError, match="split experts only"):
        whole.reconfigure({0: 4, 1: 4}, {0: 1, 1: 1})
    with pytest.raises(ValueError, match="loads nothing ahead"):
        whole.prefetch_bottoms([ExpertKey(0, 1)])
    for s in (store, whole):
        s.close()


def test_a_split_store_caches_top_parts_streams_bottoms_and_drops_new_bottoms_when_reconfigured():
    store, reader = make_store(8, streams=2)
    store.use(SplitParts(2, {0: 1, 1: 2}))
    assert consume(store, 0, [0, 1, 2, 3]) == [value(ExpertKey(0, u)) for u in range(4)]
    assert consume(store, 1, [0, 1]) == [value(ExpertKey(1, u)) for u in range(2)]
    table = store.device.table
    assert set(table.slot_of) == {ExpertKey(0, 0), ExpertKey(0, 2), ExpertKey(1, 0), ExpertKey(1, 1)}
    assert store.reconfigure({0: 4, 1: 4}, {0: 1, 1: 1}) == 1  # layer 1's part 1 is a bottom now
    assert set(table.slot_of) == {ExpertKey(0, 0), ExpertKey(0, 2), ExpertKey(1, 0)}
    assert store.space.tops == {0: 1, 1: 1}
    reads = len(reader.reads)
    assert consume(store, 0, [0, 1]) == [value(ExpertKey(0, 0)), value(ExpertKey(0, 1))]
    assert reader.reads[reads:] == [ExpertKey(0, 1)]  # the top a hit, the bottom streamed again
    store.close()


def test_the_store_knows_nothing_of_parts_but_its_key_space():
    """store/store.py asks its key space; it never does a part's arithmetic nor names a split's tops or bottoms."""
    tree = ast.parse(pathlib.Path(store_module.__file__).read_text())
    arithmetic = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.BinOp)
                  and any(isinstance(a, ast.Attribute) and a.attr == "expert" for a in ast.walk(n))]
    named = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
                   & {"parts", "tops", "cached_parts", "split", "part", "bottoms"})
    assert arithmetic == [] and named == []
