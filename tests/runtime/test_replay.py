"""Routing replay: the model runs for real while its experts come from a recorded trace, token by token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moepager.cli.main import main
from moepager.config import StoreConfig
from moepager.errors import MoepagerError
from moepager.runtime.llm import LLM
from moepager.runtime.replay import ReplayRequest, ReplaySpec, RouteReplayer, load_replay
from moepager.runtime.sampling import SamplingParams
from moepager.trace.format import DECODE, MISSING, PREFILL, TraceHeader, TraceReader, TraceRequest, TraceWriter
from moepager.types import PassInfo
from tests.conftest import expert_budget
from tests.trace.conftest import random_trace


@pytest.fixture(scope="module")
def olmoe(hf_checkpoint):
    _, path = hf_checkpoint("olmoe")  # 3 MoE layers, 8 experts, top-2
    return path


def test_replay_routes_every_token_as_recorded(olmoe, tmp_path):
    trace = random_trace(tmp_path / "t.mpt", lengths=(9, 12), prefill=4)
    llm = LLM(olmoe, show_progress=False)
    out = llm.replay(ReplaySpec(trace), record_trace=tmp_path / "seen.mpt")
    assert [len(c.prompt_token_ids) for c in out] == [4, 4]
    assert [len(c.token_ids) for c in out] == [9 - 4 + 1, 12 - 4 + 1]  # one token per decode step, + the last
    with TraceReader(trace) as want, TraceReader(tmp_path / "seen.mpt") as seen:
        for a, b in zip(want, seen, strict=True):
            assert (np.sort(a.ids_TLK, -1) == np.sort(b.ids_TLK, -1)).all()
            assert b.phase_T.tolist() == a.phase_T.tolist()
    s = llm.last_stats
    assert (s.num_prompts, s.prompt_tokens, s.generated_tokens, len(s.tpot_s)) == (2, 8, 15, 13)
    assert "replayed from" in s.table()


def test_replay_uses_recorded_weights_and_otherwise_renormalises_the_router(olmoe, tmp_path):
    header = TraceHeader("tiny", (0, 1, 2), 8, 2)
    ids = np.array([[[0, 5], [1, 2], [7, 3]]] * 6, np.int16)
    weights = np.array([[[0.9, 0.1], [0.3, 0.7], [0.5, 0.5]]] * 6, np.float32)
    phase = np.array([PREFILL] * 3 + [DECODE] * 3, np.uint8)
    with TraceWriter(tmp_path / "w.mpt", header) as w:
        w.add(TraceRequest(ids, phase, weights_TLK=weights))
        w.add(TraceRequest(ids, phase))
    llm = LLM(olmoe, show_progress=False)
    llm.replay(ReplaySpec(tmp_path / "w.mpt"), record_trace=tmp_path / "seen.mpt")
    with TraceReader(tmp_path / "seen.mpt") as seen:
        given, own = seen.request(0), seen.request(1)
    np.testing.assert_allclose(given.weights_TLK, weights, rtol=1e-6)
    gates = np.take_along_axis(own.gates_TLE, own.ids_TLK.astype(np.int64), -1)
    top2 = np.sort(own.gates_TLE, -1)[..., -2:].sum(-1, keepdims=True)  # olmoe: top-k weights unnormalised
    np.testing.assert_allclose(own.weights_TLK, gates / gates.sum(-1, keepdims=True) * top2, rtol=1e-5)


def test_replaying_the_models_own_routing_changes_nothing(olmoe, tmp_path):
    llm = LLM(olmoe, show_progress=False)
    prompts = [[5, 9, 2], [7, 1, 3, 4, 8]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    original = llm.generate(prompts, params, record_trace=tmp_path / "own.mpt")
    with TraceReader(tmp_path / "own.mpt") as reader:  # the model's name, never a path on this machine
        assert reader.header.model == olmoe.name
    replayed = llm.replay(ReplaySpec(tmp_path / "own.mpt"))
    assert [c.prompt_token_ids for c in replayed] == prompts
    assert [c.token_ids for c in replayed] == [c.token_ids for c in original]


def test_replay_is_lossless_at_every_budget(olmoe, tmp_path):
    trace = random_trace(tmp_path / "t.mpt", lengths=(10, 14, 8), prefill=2, seed=4)
    spec = ReplaySpec(trace)
    expected = [c.token_ids for c in LLM(olmoe, show_progress=False).replay(spec)]
    nbytes = LLM(olmoe, show_progress=False).loaded.expert_shape.nbytes
    for per_layer in (2, 4):
        llm = LLM(olmoe, store=StoreConfig(expert_memory=expert_budget(nbytes, per_layer * 3), warm=False),
                  show_progress=False)
        assert [c.token_ids for c in llm.replay(spec)] == expected
        assert llm.last_stats.sections["experts"].phases["decode"]["hit_rate"] < 1.0


def test_concurrent_replay_batches_requests_without_changing_their_tokens(olmoe, tmp_path):
    trace = random_trace(tmp_path / "t.mpt", lengths=(10, 14, 8, 12, 9), prefill=3, seed=5)
    spec = ReplaySpec(trace)
    llm = LLM(olmoe, show_progress=False)
    sequential = [c.token_ids for c in llm.replay(spec)]
    passes: list[int] = []
    announce = llm.engine.runner.on_pass
    llm.engine.runner.on_pass = lambda info: (passes.append(len(info.requests)), announce(info))
    assert [c.token_ids for c in llm.replay(spec, concurrency=3, record_trace=tmp_path / "seen.mpt")] == sequential
    assert max(passes) == 3  # three requests shared passes, never more
    with TraceReader(trace) as want, TraceReader(tmp_path / "seen.mpt") as seen:
        for a, b in zip(want, seen, strict=True):
            assert (np.sort(a.ids_TLK, -1) == np.sort(b.ids_TLK, -1)).all()


def test_route_prompt_turns_a_prompt_only_trace_into_decode_steps(olmoe, tmp_path):
    trace = random_trace(tmp_path / "p.mpt", lengths=(7, 9), prefill=9)  # every token recorded as prefill
    llm = LLM(olmoe, show_progress=False)
    out = llm.replay(ReplaySpec(trace, prompt_tokens=3, requests="0:2"), record_trace=tmp_path / "seen.mpt")
    assert [len(c.prompt_token_ids) for c in out] == [3, 3]
    with TraceReader(tmp_path / "seen.mpt") as seen:
        assert [r.phase_T.tolist() for r in seen] == [[PREFILL] * 3 + [DECODE] * (t - 3) for t in (7, 9)]
    out = llm.replay(ReplaySpec(trace, prompt_tokens=3, requests=[1], decode_steps=2))
    assert [len(c.token_ids) for c in out] == [3]


def test_route_layers_first_replays_a_deeper_trace(olmoe, tmp_path):
    trace = random_trace(tmp_path / "deep.mpt", layers=5, lengths=(8,))
    llm = LLM(olmoe, show_progress=False)
    with pytest.raises(MoepagerError, match=r"trace 5 MoE layers x 8 experts, top-2; model 3 MoE layers .*first"):
        llm.replay(ReplaySpec(trace))
    llm.replay(ReplaySpec(trace, layers="first"), record_trace=tmp_path / "seen.mpt")
    with TraceReader(trace) as want, TraceReader(tmp_path / "seen.mpt") as seen:
        assert (np.sort(want.request(0).ids_TLK[:, :3], -1) == np.sort(seen.request(0).ids_TLK, -1)).all()


@pytest.mark.parametrize("spec, message", [
    (dict(requests="2:5"), r"request range 2:5 is outside the trace's 2 requests"),
    (dict(requests=[0, 7]), r"request indices \[7\] are outside"),
    (dict(decode_steps=50), r"has fewer tokens than asked: 4 prompt tokens \+ 50 decode steps"),
    (dict(prompt_tokens=40), r"fewer tokens than asked: 40 prompt tokens"),
    (dict(requests="x"), r"must look like A:B"),
])
def test_bad_replay_requests_are_refused(olmoe, tmp_path, spec, message):
    trace = random_trace(tmp_path / "t.mpt", lengths=(9, 12))
    with pytest.raises(MoepagerError, match=message):
        LLM(olmoe, show_progress=False).replay(ReplaySpec(trace, **spec))


def test_replay_refuses_bad_traces_and_writes_nothing(olmoe, tmp_path):
    llm = LLM(olmoe, show_progress=False)
    (tmp_path / "junk.mpt").write_bytes(b"not a zip at all")
    with pytest.raises(MoepagerError, match="not a moepager trace"):
        llm.replay(ReplaySpec(tmp_path / "junk.mpt"), record_trace=tmp_path / "out.mpt")
    wrong = random_trace(tmp_path / "wrong.mpt", experts=16, top_k=3)
    with pytest.raises(MoepagerError, match=r"trace 3 MoE layers x 16 experts, top-3; model 3 MoE layers x 8 experts"):
        llm.replay(ReplaySpec(wrong), record_trace=tmp_path / "out.mpt")
    decode_only = random_trace(tmp_path / "d.mpt", prefill=0)
    with pytest.raises(MoepagerError, match="--route-prompt"):
        llm.replay(ReplaySpec(decode_only))
    trace = random_trace(tmp_path / "t.mpt")
    with pytest.raises(MoepagerError, match="is the trace being replayed"):
        llm.replay(ReplaySpec(trace), record_trace=tmp_path / "." / "t.mpt")
    assert not (tmp_path / "out.mpt").exists()


def test_generate_cli_replays_and_checks_its_options(olmoe, tmp_path, capsys):
    trace = random_trace(tmp_path / "t.mpt", lengths=(9, 12))
    assert main(["generate", "--model", str(olmoe), "--route-from", str(trace), "--route-requests", "1:2",
                 "--quiet", "--stats-json", str(tmp_path / "s.json")]) == 0
    assert "replayed 1 requests" in capsys.readouterr().out
    for argv, message in ((["--route-from", str(trace), "hello"], "give no PROMPT"),
                          (["--route-prompt", "3", "hello"], "need --route-from"),
                          ([], "give at least one PROMPT"),
                          (["--route-from", str(tmp_path / "none.mpt")], "does not exist")):
        assert main(["generate", "--model", str(olmoe), "--quiet", *argv]) == 2
        assert message in capsys.readouterr().err


def test_the_replayer_tells_the_oracle_each_rows_recorded_and_following_routing(tmp_path):
    """`recorded(column, ahead)`: this pass's recorded ids at a MoE layer, or those of the token after each row
    (MISSING after a request's last recorded token), across the rows of several requests."""
    ids_a = np.arange(5 * 3 * 2, dtype=np.int64).reshape(5, 3, 2) % 8
    ids_b = (np.arange(4 * 3 * 2, dtype=np.int64).reshape(4, 3, 2) + 3) % 8
    requests = {7: ReplayRequest(0, "a", [1, 2], 3, ids_a, None), 9: ReplayRequest(1, "b", [1], 3, ids_b, None)}
    replayer = RouteReplayer(requests, [0, 2, 5], torch.device("cpu"))
    replayer.begin_pass(PassInfo(0, "prefill", (7, 9), (0, 2), (2, 2), ("prefill", "decode"), torch.zeros(4)))
    assert replayer.recorded(1, 0).tolist() == [ids_a[0, 1].tolist(), ids_a[1, 1].tolist(), ids_b[2, 1].tolist(),
                                                ids_b[3, 1].tolist()]
    assert replayer.recorded(2, 1).tolist() == [ids_a[1, 2].tolist(), ids_a[2, 2].tolist(), ids_b[3, 2].tolist(),
                                                [MISSING, MISSING]]  # request b has no token after its fourth


def test_the_replayer_hands_out_each_rows_recorded_tokens(olmoe, tmp_path):
    """`recorded_tokens()`: the trace's tokens at this pass's positions, rows in order across requests; None as
    soon as one of the pass's requests was recorded without tokens. load_replay carries a trace's strings."""
    ids = np.zeros((5, 3, 2), dtype=np.int64)
    requests = {7: ReplayRequest(0, "a", [1, 2], 3, ids, None, ["The", "Ġcat", "Ġsat", "Ġon", "Ġit"]),
                9: ReplayRequest(1, "b", [1], 4, ids, None, [4, 5, 6, 7, 8]),
                11: ReplayRequest(2, "c", [1], 4, ids, None)}
    replayer = RouteReplayer(requests, [0, 2, 5], torch.device("cpu"))
    replayer.begin_pass(PassInfo(0, "prefill", (7, 9), (0, 3), (2, 1), ("prefill", "decode"), torch.zeros(3)))
    assert replayer.recorded_tokens() == ["The", "Ġcat", 7]
    assert replayer.recorded_token(7, 1) == "Ġcat" and replayer.recorded_token(9, 3) == 7
    assert replayer.recorded_token(11, 0) is None and replayer.recorded_token(7, 5) is None
    replayer.begin_pass(PassInfo(1, "decode", (9, 11), (4, 1), (1, 1), ("decode", "decode"), torch.zeros(2)))
    assert replayer.recorded_tokens() is None
    path = tmp_path / "t.mpt"
    header = TraceHeader("tiny", (1, 2, 3), 8, 2, expert_bytes=1 << 20)
    with TraceWriter(path, header) as w:
        w.add(TraceRequest(np.zeros((4, 3, 2), np.int16) + np.arange(2, dtype=np.int16), np.array([PREFILL] * 2 +
                           [DECODE] * 2, np.uint8), name="r", tokens=["a", "b", "c", "d"]))
        w.add(TraceRequest(np.zeros((3, 3, 2), np.int16) + np.arange(2, dtype=np.int16), np.array([PREFILL] * 2 +
                           [DECODE], np.uint8), name="no tokens"))
    loaded = load_replay(ReplaySpec(path), LLM(olmoe, show_progress=False).loaded.config)
    assert [r.tokens for r in loaded] == [["a", "b", "c", "d"], None]
