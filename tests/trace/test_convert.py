"""Converters on tiny fixtures written here, in each public format; round trips and refusals."""

from __future__ import annotations

import collections
import gzip
import json
import pickle

import numpy as np
import pytest

from moepager.cli.main import main
from moepager.trace.convert import ConvertOptions, convert
from moepager.trace.format import DECODE, MISSING, PREFILL, TraceError, TraceReader


def test_deepseek_csv(tmp_path):
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(64, 6, replace=False) for _ in range(3)]) for _ in range(26)])  # [L,T,K]
    lines = ["Layer ID,Batch Number,Token,Activated Expert IDs"]
    for layer in range(26):
        for t, tok in enumerate(["<s>", "How", "Ġdo"]):
            lines.append(f'{layer + 1},0,{tok},"{json.dumps(ids[layer, t].tolist())}"')
    src = tmp_path / "csvs"
    src.mkdir()
    with gzip.open(src / "prompt_2_data.csv.gz", "wt") as f:
        f.write("\n".join(lines) + "\n")
    (src / "prompt_10_data.csv").write_text("\n".join(lines[:1] + lines[1:4] + lines[4:]) + "\n")
    summary = convert("deepseek-csv", src, tmp_path / "ds.mpt")
    assert (summary.requests, summary.tokens) == (2, 6)
    with TraceReader(tmp_path / "ds.mpt") as r:
        assert r.header.moe_layers == tuple(range(1, 27)) and r.header.top_k == 6 and r.header.num_shared == 2
        first = r.request(0)
        assert first.name == "prompt_2_data.csv.gz" and first.tokens == ["<s>", "How", "Ġdo"]
        np.testing.assert_array_equal(first.ids_TLK, ids.transpose(1, 0, 2))
        assert (first.phase_T == PREFILL).all()
    (src / "prompt_3_data.csv").write_text("Layer,Token\n1,x\n")
    with pytest.raises(TraceError, match="expected the header"):
        convert("deepseek-csv", src, tmp_path / "bad.mpt")
    assert not (tmp_path / "bad.mpt").exists() and not (tmp_path / "bad.mpt.partial").exists()


def _mixtral_rows(problem, layers=4, tokens=3, drop=None):
    rows = []
    for layer in range(layers):
        kept = [t for t in range(tokens) if (layer, t) != drop]
        for idx, t in enumerate(kept):  # the recorder renumbers after a drop
            rows.append({"dataset": "he", "problem_id": problem, "layer": layer, "token_idx": idx,
                         "experts": [(t + layer) % 8, (t + layer + 1) % 8], "gating_probs": [0.7, 0.3]})
    return rows


def test_mixtral_jsonl_flags_dropped_tokens(tmp_path):
    path = tmp_path / "he_2_routing.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _mixtral_rows(0, drop=(2, 1)) + _mixtral_rows(1)) + "\n")
    assert convert("mixtral-jsonl", path, tmp_path / "m.mpt").missing_entries == 2
    with TraceReader(tmp_path / "m.mpt") as r:
        a, b = list(r)
        assert a.meta["dropped_per_layer"] == {"2": 1} and not a.meta["aligned"] and b.meta["aligned"]
        assert (a.ids_TLK[2, 2] == MISSING).all() and a.ids_TLK.shape == (3, 4, 2) and (a.phase_T == DECODE).all()
        assert a.ids_TLK[0, 1].tolist() == [1, 2] and a.weights_TLK[0, 1].tolist() == pytest.approx([0.7, 0.3])


def test_mixtral_raw_stream_aligns_passes(tmp_path):
    rows = []
    for layer in range(3):  # prefill pass: 2 tokens; layer 1 lost token 1
        for pos in range(2):
            if (layer, pos) != (1, 1):
                rows.append({"dataset": "he", "problem_id": 0, "layer": layer, "token_pos": pos,
                             "experts": [layer, pos + 3], "gating_probs": [0.6, 0.4]})
    for step in range(2):  # two decode passes; the second lost layer 0
        for layer in range(3):
            if (step, layer) != (1, 0):
                rows.append({"dataset": "he", "problem_id": 0, "layer": layer, "token_pos": 0,
                             "experts": [step + 5, layer], "gating_probs": [0.6, 0.4]})
    path = tmp_path / "routing_raw.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    convert("mixtral-raw", path, tmp_path / "raw.mpt")
    (req,) = list(TraceReader(tmp_path / "raw.mpt"))
    assert req.phase_T.tolist() == [PREFILL, PREFILL, DECODE, DECODE]
    assert req.ids_TLK[1, 1].tolist() == [MISSING, MISSING] and req.ids_TLK[3, 0].tolist() == [MISSING, MISSING]
    assert req.ids_TLK[3, 2].tolist() == [6, 2] and req.meta["missing_entries"] == 2
    with pytest.raises(TraceError, match="mixtral-raw"):
        convert("mixtral-jsonl", tmp_path / "routing_raw.jsonl", tmp_path / "x.mpt")


def test_expert_selection_steps(tmp_path):
    steps = [{"0": None, "1": [[0, 1], [2, 3], [1, 3]], "2": [[4, 5], [5, 6], [0, 7]]},
             {"0": None, "1": [[3, 0]], "2": [[7, 1]]}, {"0": None, "1": [[2, 1]], "2": [[6, 5]]}]
    (tmp_path / "req_a.json").write_text(json.dumps(steps))
    convert("expert-selection-json", tmp_path / "req_a.json", tmp_path / "s.mpt", ConvertOptions(num_experts=8))
    with TraceReader(tmp_path / "s.mpt") as r:
        assert r.header.moe_layers == (1, 2) and r.header.num_experts == 8 and r.header.top_k == 2
        (req,) = list(r)
    assert req.phase_T.tolist() == [PREFILL] * 3 + [DECODE] * 2
    assert req.ids_TLK[:, 1].tolist() == [[4, 5], [5, 6], [0, 7], [7, 1], [6, 5]]


def test_olmoe_counts_become_priors_and_hostile_pickles_are_refused(tmp_path):
    folder, top1 = tmp_path / "olmoe" / "expert_counts", tmp_path / "olmoe" / "expert_counts_top1"
    folder.mkdir(parents=True)
    top1.mkdir()
    counts = [collections.Counter({np.int64(e): 2 * (e + 1) for e in range(4)}) for _ in range(3)]
    firsts = [collections.Counter({np.int64(e): e + 1 for e in range(4)}) for _ in range(3)]
    (folder / "arxiv.pkl").write_bytes(pickle.dumps(counts))
    (top1 / "arxiv.pkl").write_bytes(pickle.dumps(firsts))
    assert convert("olmoe-counts", folder, tmp_path / "p.mpt").priors == 1
    with TraceReader(tmp_path / "p.mpt") as r:
        assert r.header.moe_layers == (0, 7, 15) and r.header.top_k == 2
        assert r.header.model == "allenai/OLMoE-1B-7B-0924"
        np.testing.assert_array_equal(r.prior("arxiv")[1], [2, 4, 6, 8])

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (folder / "evil.pkl").write_bytes(pickle.dumps([Evil()]))
    with pytest.raises(TraceError, match="refusing to unpickle builtins.print"):
        convert("olmoe-counts", folder, tmp_path / "q.mpt")


def test_cli_convert_and_info(tmp_path, capsys):
    path = tmp_path / "he_2_routing.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _mixtral_rows(0)))
    assert main(["trace", "convert", "--format", "mixtral-jsonl", str(path), str(tmp_path / "m.mpt")]) == 0
    assert main(["trace", "info", str(tmp_path / "m.mpt")]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "top-2" in out and "3 (3 recorded as decode" in out
    assert main(["trace", "info", str(tmp_path / "none.mpt")]) == 2
