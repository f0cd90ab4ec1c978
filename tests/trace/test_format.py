"""Trace format v1: round trip, streaming, and clear errors for bad input."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from moepager.trace.format import DECODE, PREFILL, TraceError, TraceHeader, TraceReader, TraceRequest, TraceWriter

HEADER = TraceHeader("tiny", (1, 2), num_experts=4, top_k=2, num_shared=1, expert_bytes=1234, source="test")


def _request(t=3, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(4, 2, replace=False) for _ in range(2)]) for _ in range(t)]).astype(np.int16)
    gates = rng.random((t, 2, 4)).astype(np.float32)
    return TraceRequest(ids, np.array([PREFILL] + [DECODE] * (t - 1), np.uint8), rng.random((t, 2, 2), np.float32),
                        gates, np.arange(t), [f"tok{i}" for i in range(t)], "a prompt", f"req{seed}", {"k": 1})


def test_round_trip_every_field(tmp_path):
    path = tmp_path / "t.mpt"
    written = [_request(3, 0), _request(5, 1)]
    with TraceWriter(path, HEADER) as w:
        for r in written:
            w.add(r)
        w.add_prior("counts", np.arange(8.0).reshape(2, 4))
    with TraceReader(path) as reader:
        assert reader.header == HEADER and len(reader) == 2 and reader.prior_names == ["counts"]
        for got, want in zip(reader, written, strict=True):
            for name in ("ids_TLK", "phase_T", "weights_TLK", "gates_TLE", "token_ids_T"):
                np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
            assert (got.tokens, got.prompt, got.name, got.meta) == (want.tokens, want.prompt, want.name, want.meta)
        np.testing.assert_array_equal(reader.prior("counts"), np.arange(8.0).reshape(2, 4))
    assert zipfile.ZipFile(path).getinfo("requests/0000000/ids_TLK.npy").compress_type == zipfile.ZIP_DEFLATED


def test_validation_and_corruption_errors(tmp_path):
    bad = _request()
    bad.ids_TLK[0, 0] = [1, 1]
    with pytest.raises(TraceError, match="appears twice"), TraceWriter(tmp_path / "a.mpt", HEADER) as w:
        w.add(bad)
    out_of_range = _request()
    out_of_range.ids_TLK[0, 0, 0] = 9
    with pytest.raises(TraceError, match=r"outside 0\.\.3"), TraceWriter(tmp_path / "b.mpt", HEADER) as w:
        w.add(out_of_range)
    with pytest.raises(TraceError, match="does not exist"):
        TraceReader(tmp_path / "missing.mpt")
    (tmp_path / "junk.mpt").write_bytes(b"not a zip")
    with pytest.raises(TraceError, match="not a moepager trace"):
        TraceReader(tmp_path / "junk.mpt")
    with zipfile.ZipFile(tmp_path / "v2.mpt", "w") as z:
        z.writestr("header.json", json.dumps({"schema_version": 2}))
    with pytest.raises(TraceError, match="schema version 2 is not supported"):
        TraceReader(tmp_path / "v2.mpt")
    with pytest.raises(TraceError, match="invalid trace header"):
        TraceHeader("x", (0,), num_experts=2, top_k=3)
