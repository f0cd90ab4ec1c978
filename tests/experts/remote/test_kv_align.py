"""OD-MoE's KV alignment, the main rank's side and the cache copies (experts/remote/kv_align.py): which positions each
pass sends, and that the entries written are the ones read, at the right slots and nowhere else."""

from __future__ import annotations

import pytest
import torch

from moepager.errors import MoepagerError
from moepager.experts.remote.kv_align import FORGET_AFTER, KVAligner, gather, slots, write
from moepager.types import PassInfo

BLOCK = 4


def info(pass_id: int, rows: list[tuple[int, int, int]], blocks: dict[int, list[int]]) -> PassInfo:
    """A pass of `rows` (request, start, count), each request holding `blocks[request]`."""
    requests, starts, counts = zip(*rows, strict=True)
    return PassInfo(pass_id, "decode", requests, starts, counts, ("decode",) * len(rows),
                    torch.zeros(sum(counts), dtype=torch.long), tuple(blocks[r] for r in requests))


def sent(aligner: KVAligner, pass_id: int, rows: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    blocks = {r: [1, 2, 3] for r, _, _ in rows}
    return [span for span, _ in aligner.spans(info(pass_id, rows, blocks))]


def test_each_pass_sends_the_positions_computed_since_a_requests_last_alignment():
    aligner = KVAligner(1)
    assert sent(aligner, 0, [(7, 0, 5)]) == []  # a prompt: nothing computed before it
    assert sent(aligner, 1, [(7, 5, 1), (8, 0, 3)]) == [(7, 0, 5)]  # the prompt's positions, late departure
    assert sent(aligner, 2, [(7, 6, 1), (8, 3, 1)]) == [(7, 5, 1), (8, 0, 3)]
    assert sent(aligner, 3, [(8, 4, 1)]) == [(8, 3, 1)]  # request 7 is not in the pass: its turn comes with it
    assert sent(aligner, 4, [(7, 7, 1), (8, 5, 1)]) == [(7, 6, 1), (8, 4, 1)]
    assert sent(aligner, 5, [(7, 0, 8)]) == []  # preempted: computed again from its first token, nothing to send
    assert sent(aligner, 6, [(7, 8, 1)]) == [(7, 0, 8)]


def test_a_period_sends_every_position_once_at_the_due_passes():
    aligner = KVAligner(3)
    got = [sent(aligner, p, [(1, 0, 4)] if p == 0 else [(1, 3 + p, 1)]) for p in range(8)]
    assert got == [[], [], [], [(1, 0, 6)], [], [], [(1, 6, 3)], []]  # passes 0, 3, 6 are due


def test_a_request_no_pass_carries_for_long_is_forgotten_and_then_sent_whole():
    aligner = KVAligner(1)
    sent(aligner, 0, [(1, 0, 4)])
    sent(aligner, 1, [(1, 4, 1)])
    for p in range(2, 2 * FORGET_AFTER):  # (forgotten at the second look: the first is less than FORGET_AFTER on)
        sent(aligner, p, [(2, 0, 1)] if p == 2 else [(2, p - 2, 1)])
    assert 1 not in aligner.sent and 2 in aligner.sent
    p = 2 * FORGET_AFTER
    assert sent(aligner, p, [(1, 5, 1)]) == []  # nothing known of it: it counts again from here
    assert sent(aligner, p + 1, [(1, 6, 1)]) == [(1, 0, 6)]


def test_slots_follow_the_block_table():
    assert slots([5, 2, 9], 2, 5, BLOCK).tolist() == [22, 23, 8, 9, 10]


def test_entries_are_written_at_their_slots_in_the_caches_dtype_and_nowhere_else():
    torch.manual_seed(0)
    main = [torch.randn(6, BLOCK, 2, 3), torch.randn(6, BLOCK, 1, 5)]  # two layers of different entry shapes
    shadow = [torch.zeros(6, BLOCK, 2, 3, dtype=torch.bfloat16), torch.zeros(6, BLOCK, 1, 5, dtype=torch.bfloat16)]
    at_main, at_shadow = slots([3, 1], 2, 4, BLOCK), slots([4, 5], 2, 4, BLOCK)
    entries = gather(main, at_main)
    assert entries.shape == (4, 2 * 3 + 5)
    write(shadow, at_shadow, entries)
    for m, s in zip(main, shadow, strict=True):
        flat_m, flat_s = m.view(-1, *m.shape[2:]), s.view(-1, *s.shape[2:])
        assert torch.equal(flat_s[at_shadow], flat_m[at_main].to(torch.bfloat16))
        untouched = torch.ones(len(flat_s), dtype=torch.bool)
        untouched[at_shadow] = False
        assert not flat_s[untouched].any()
    with pytest.raises(MoepagerError, match="different models"):
        write(shadow, at_shadow, entries[:, :7])


def test_payload_counts_the_positions_and_bytes_it_sends():
    class Pool:
        block_size = BLOCK
        cache = [torch.randn(4, BLOCK, 2, 3)]

    aligner = KVAligner(1)
    assert aligner.payload(info(0, [(1, 0, 6)], {1: [2, 3]}), Pool()) is None
    spans, entries = aligner.payload(info(1, [(1, 6, 1)], {1: [2, 3]}), Pool())
    assert spans.tolist() == [[1, 0, 6]] and torch.equal(entries, gather(Pool.cache, slots([2, 3], 0, 6, BLOCK)))
    assert (aligner.positions, aligner.bytes) == (6, 6 * 6 * 4)
