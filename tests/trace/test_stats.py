"""Routing statistics of a trace: entropy, top-quarter share and the same-expert-as-previous-token rate."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moepager.cli.main import main
from moepager.trace.format import DECODE, MISSING, TraceHeader, TraceRequest, TraceWriter
from moepager.trace.stats import routing_stats


def write(path, requests, experts=4, top_k=2):
    with TraceWriter(path, TraceHeader("hand", (3, 5), experts, top_k)) as w:
        for i, ids in enumerate(requests):
            ids = np.array(ids, np.int16)
            w.add(TraceRequest(ids, np.full(len(ids), DECODE, np.uint8), name=f"r{i}"))
    return path


def test_hand_counted_statistics(tmp_path):
    # layer 3 always routes to {0, 1}; layer 5 walks {0,1} -> {1,2} -> {2,3} -> {3,0}
    request = [[[0, 1], [0, 1]], [[1, 0], [1, 2]], [[0, 1], [2, 3]], [[1, 0], [3, 0]]]
    stats = routing_stats(str(write(tmp_path / "t.mpt", [request, request[:1]])))
    first, second = stats.layers
    assert (stats.requests, stats.tokens, first.layer, second.layer) == (2, 5, 3, 5)
    assert first.repeat_rate == 1.0 and second.repeat_rate == pytest.approx(0.5)  # 3 pairs, 1 of 2 shared each
    assert first.entropy_bits == pytest.approx(1.0) and first.entropy_ratio == pytest.approx(0.5)
    assert first.top_quarter_share == pytest.approx(0.5)  # one expert of four takes half the choices
    # layer 5 counts: 0:3 1:3 2:2 3:2 of 10
    p = np.array([3, 3, 2, 2]) / 10
    assert second.entropy_bits == pytest.approx(float(-(p * np.log2(p)).sum()))
    assert stats.repeat_rate_random == 0.5


def test_missing_entries_and_request_boundaries_are_skipped(tmp_path):
    a = [[[0, 1], [0, 1]], [[0, 1], [MISSING, MISSING]], [[0, 1], [0, 1]]]
    b = [[[2, 3], [2, 3]]]  # its first token has no predecessor: not compared with a's last token
    stats = routing_stats(str(write(tmp_path / "t.mpt", [a, b])))
    assert stats.layers[0].repeat_rate == 1.0
    assert stats.layers[1].repeat_rate == 0.0  # at layer 5 no pair of consecutive tokens is complete
    assert stats.layers[1].choices == 6


def test_trace_stats_cli(tmp_path, capsys):
    path = write(tmp_path / "t.mpt", [[[[0, 1], [0, 1]], [[0, 2], [1, 2]]]])
    assert main(["trace", "stats", str(path), "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "repeat rate" in out and "mean" in out
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["layers"][0]["repeat_rate"] == 0.5 and "mean" in data
