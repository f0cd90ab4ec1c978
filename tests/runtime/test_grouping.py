"""ExpertFlow's token scheduler: balanced 2-means on path similarity, the path tracker, the `expertflow` batch policy's
turns and wait bound on fake requests, and its tokens against FIFO's on a real model."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from moepager.config import EngineConfig, PrefetchConfig, SchedulerConfig, StoreConfig
from moepager.runtime.batch_policy import batch_policy
from moepager.runtime.batch_policy.expertflow import WAIT_BOUND, ExpertFlowPolicy, PathTracker
from moepager.runtime.grouping import (
    balanced_two_means,
    exact_best_split,
    expected_cost,
    group,
    split_cost,
    swap_search,
    union_size,
)
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from moepager.runtime.scheduler import Scheduler
from moepager.types import PassInfo, RoutingDecision
from tests.runtime.test_scheduler import FakePool, FakeRequest, step


def clustered(n: int, layers: int = 4, experts: int = 16, k: int = 2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Paths of two planted clusters (each prefers its own half of the experts), in interleaved order, and each
    row's cluster."""
    rng = np.random.default_rng(seed)
    cluster = np.arange(n) % 2
    paths = np.zeros((n, layers, experts), bool)
    for i in range(n):
        for layer in range(layers):
            half = rng.choice(experts // 2, size=k, replace=False) + cluster[i] * experts // 2
            paths[i, layer, half] = True
    return paths.reshape(n, -1), cluster


def test_two_means_is_balanced_deterministic_and_finds_planted_clusters():
    paths, cluster = clustered(10)
    first, second = balanced_two_means(paths)
    assert (len(first), len(second)) == (5, 5) and sorted(first + second) == list(range(10))
    assert (first, second) == balanced_two_means(paths)  # deterministic
    assert len({int(cluster[i]) for i in first}) == 1 and len({int(cluster[i]) for i in second}) == 1
    fifo = union_size(paths, range(5)) + union_size(paths, range(5, 10))  # oldest half, newest half
    assert union_size(paths, first) + union_size(paths, second) < fifo
    odd = balanced_two_means(paths[:7])
    assert (len(odd[0]), len(odd[1])) == (4, 3)
    assert balanced_two_means(paths[:1]) == ([0], [])


@dataclass
class Tracked(FakeRequest):
    request_id: int = 0


class FakePaths:
    """PathTracker's view for the scheduler: fixed paths by request id."""

    def __init__(self, paths: np.ndarray):
        self.paths = {i: p for i, p in enumerate(paths)}
        self.column = {layer: layer for layer in range(4)}
        self.num_experts = 16
        self.updates = 0
        """Times groups were formed (each asks the paths to update first)."""

    def path(self, request: int) -> np.ndarray | None:
        return self.paths.get(request)

    def update(self, decoding) -> None:
        self.updates += 1

    def forget(self, request: int) -> None:
        self.paths.pop(request, None)


def expertflow(max_seqs: int, paths: np.ndarray) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_batched_tokens=64, batch_policy="expertflow")
    return Scheduler(config, FakePool(64), batch_policy(config, FakePaths(paths)))


def test_expertflow_runs_twice_the_requests_as_two_similar_groups_in_turns():
    paths, cluster = clustered(8)
    s = expertflow(4, paths)
    requests = [Tracked(str(i), [1] * 2, request_id=i) for i in range(8)]
    for r in requests:
        s.add(r)
    assert len(step(s)) == 8  # all 8 admitted (twice --max-num-seqs), their prompts in one step
    turns = [{int(name) for name, *_ in step(s)} for _ in range(6)]
    for a, b in zip(turns[::2], turns[1::2]):
        assert len(a) == len(b) == 4 and a | b == set(range(8))  # a pair of steps decodes every request once
        assert len({int(cluster[i]) for i in a}) == 1  # each group is one planted cluster
    # the paths are asked to update before each grouping: the first pair's (inline), then each pair's second
    # step forms the next pair's on the pipeline's thread
    assert s.policy.paths.updates == 4
    waits = {i: 0 for i in range(8)}
    for turn in turns:
        for i in waits:
            waits[i] = 0 if i in turn else waits[i] + 1
            assert waits[i] <= WAIT_BOUND


def test_expertflow_takes_everyone_when_one_step_holds_them_and_bounds_the_wait_of_newcomers():
    paths, _ = clustered(6)
    s = expertflow(4, paths)
    requests = [Tracked(str(i), [1] * (2 if i < 3 else 6), request_id=i) for i in range(6)]
    for r in requests:
        s.add(r)
    step(s)  # prompts: 0-2 finish theirs (2 tokens), 3-5 too (6 tokens, budget 64)
    last_seen = {i: 0 for i in range(6)}
    for t in range(1, 12):
        ran = {int(name) for name, *_ in step(s)}
        for i in ran:
            assert t - last_seen[i] <= WAIT_BOUND + 1
            last_seen[i] = t
        if t == 5:
            s.finish(requests[0])  # 5 decoding: still more than one step takes
            s.finish(requests[1])  # 4 decoding: one step takes them all again
            last_seen.pop(0), last_seen.pop(1)
        if t > 6:
            assert ran == {2, 3, 4, 5}


def test_the_path_tracker_keeps_each_requests_last_routed_token():
    tracker = PathTracker([1, 3], num_experts=4)
    info = PassInfo(0, "prefill", (7, 9), (0, 0), (2, 1), ("prefill", "prefill"), torch.tensor([1, 2, 3]))
    tracker.begin_pass(info)
    for layer, ids in ((1, [[0, 1], [2, 3], [1, 2]]), (3, [[3, 0], [0, 2], [1, 3]])):
        ids_TK = torch.tensor(ids)
        tracker.routed(layer, torch.zeros(3, 2), RoutingDecision(ids_TK, ids_TK.float(), ids_TK.float(), ids_TK), ())
    path7 = tracker.path(7)
    assert path7 is not None and np.flatnonzero(path7).tolist() == [2, 3, 4, 6]  # its 2nd token: {2,3} and {0,2}
    assert np.flatnonzero(tracker.path(9)).tolist() == [1, 2, 5, 7]
    tracker.forget(7)
    assert tracker.path(7) is None


def test_the_path_tracker_takes_the_predictors_next_token_forecast_when_it_has_one():
    from moepager.predictors.base import Forecast

    probs = {0: torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.7, 0.2, 0.05, 0.05], [0.0, 0.0, 0.2, 0.8]]),
             1: torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.05, 0.15, 0.7], [0.3, 0.0, 0.6, 0.1]])}
    forecasts = {"all": lambda j, ahead: Forecast(probs[j]) if ahead == 1 else None,
                 "one layer": lambda j, ahead: Forecast(probs[j]) if ahead == 1 and j == 0 else None}
    for kind, forecast in forecasts.items():
        tracker = PathTracker([1, 3], num_experts=4, forecast=forecast, top_k=2)
        info = PassInfo(0, "prefill", (7, 9), (0, 0), (2, 1), ("prefill", "prefill"), torch.tensor([1, 2, 3]))
        tracker.begin_pass(info)
        for layer, ids in ((1, [[0, 1], [2, 3], [1, 2]]), (3, [[3, 0], [0, 2], [1, 3]])):
            ids_TK = torch.tensor(ids)
            tracker.routed(layer, torch.zeros(3, 2), RoutingDecision(ids_TK, ids_TK.float(), ids_TK.float(), ids_TK),
                           ())
        if kind == "all":  # request 7's next token: forecast row 1 ({0, 1} and {2, 3}), request 9's: row 2
            assert np.flatnonzero(tracker.path(7)).tolist() == [0, 1, 6, 7]
            assert np.flatnonzero(tracker.path(9)).tolist() == [2, 3, 4, 6]
            assert tracker.forecast_passes == 1
        else:  # a layer without a forecast: the routing's path, as without a predictor
            assert np.flatnonzero(tracker.path(7)).tolist() == [2, 3, 4, 6] and tracker.forecast_passes == 0


def test_expertflow_groups_by_a_predictors_paths_and_gives_fifos_tokens(hf_checkpoint, tmp_path):
    from moepager.trace.fit import fit_transition
    from moepager.trace.format import TraceReader

    _, path = hf_checkpoint("olmoe")
    LLM(path, show_progress=False).generate([[3, 4, 5, 6], [9, 10, 11]], SamplingParams(max_tokens=20, ignore_eos=True),
                                            record_trace=tmp_path / "t.mpt")
    with TraceReader(tmp_path / "t.mpt") as reader:
        fit_transition(reader, list(range(len(reader))), [1, 2, 3]).save(tmp_path / "transition.pt")
    out, llm = fifo_and_expertflow(path, PrefetchConfig("transition", file=str(tmp_path / "transition.pt")))
    assert llm.paths is not None and llm.paths.forecast_passes > 0
    assert out["fifo"] == out["expertflow"]


PROMPTS = [[3, 11, 5], [7, 1], [2, 2, 9, 4], [5], [8, 6, 1], [4, 4]]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def fifo_and_expertflow(path, prefetch) -> tuple[dict[str, list[list[int]]], LLM]:
    """FIFO's and expertflow's tokens on `PROMPTS` (batch-invariant, 2 a step, experts paged at 50%, `prefetch`'s
    predictor), and the expertflow engine."""
    out = {}
    for policy in ("fifo", "expertflow"):
        config = EngineConfig(model=str(path), store=StoreConfig(expert_memory="50%"), prefetch=prefetch,
                              scheduler=SchedulerConfig(max_num_seqs=2, batch_policy=policy, batch_invariant=True))
        llm = LLM(config=config, show_progress=False)
        out[policy] = [c.token_ids for c in llm.generate(PROMPTS, PARAMS)]
    return out, llm


@dataclass
class Decoding:
    """A decoding request as the tracker reads it: all but its last token computed."""

    request_id: int
    ids: list[int]

    @property
    def num_computed(self) -> int:
        return len(self.ids) - 1

    def tokens(self, start: int, count: int) -> list[int]:
        return self.ids[start:start + count]


def test_the_path_tracker_takes_a_lookahead_of_each_decoding_requests_next_token():
    """Where the predictor forecasts from the next token itself (the path predictor's `lookahead`), forming groups
    asks it for every decoding request at its next position; a request it does not follow keeps its routing."""
    asked = []

    def lookahead(request: int, start: int, token: int) -> torch.Tensor | None:
        asked.append((request, start, token))
        return torch.tensor([[0.9, 0.0, 0.8, 0.1], [0.0, 0.7, 0.1, 0.6]]) if request == 7 else None

    tracker = PathTracker([1, 3], num_experts=4, top_k=2, lookahead=lookahead)
    info = PassInfo(0, "prefill", (7, 9), (0, 0), (2, 1), ("prefill", "prefill"), torch.tensor([1, 2, 3]))
    tracker.begin_pass(info)
    for layer, ids in ((1, [[0, 1], [2, 3], [1, 2]]), (3, [[3, 0], [0, 2], [1, 3]])):
        ids_TK = torch.tensor(ids)
        tracker.routed(layer, torch.zeros(3, 2), RoutingDecision(ids_TK, ids_TK.float(), ids_TK.float(), ids_TK), ())
    tracker.update([Decoding(7, [5, 6, 11]), Decoding(9, [4, 12])])
    assert asked == [(7, 2, 11), (9, 1, 12)]
    # the lookahead's path keeps its probabilities (the grouping reads them as such)
    assert tracker.path(7).tolist() == pytest.approx([0.9, 0.0, 0.8, 0.1, 0.0, 0.7, 0.1, 0.6])
    assert tracker.path(7).dtype == np.float32 and tracker.lookahead_paths == 1
    assert np.flatnonzero(tracker.path(9)).tolist() == [1, 2, 5, 7]  # its routing, as without a lookahead


def test_expertflow_groups_by_the_path_predictors_lookahead_and_gives_fifos_tokens(hf_checkpoint, tmp_path):
    from moepager.predictors.path import PathFit
    from moepager.runtime.replay import ReplaySpec
    from moepager.trace.fit import fit_path
    from moepager.trace.format import TraceReader, TraceWriter

    _, path = hf_checkpoint("olmoe")
    LLM(path, show_progress=False).generate(PROMPTS, PARAMS, record_trace=tmp_path / "t.mpt")
    with TraceReader(tmp_path / "t.mpt") as reader:
        fit_path(reader, list(range(len(reader))), PathFit(epochs=2), lambda n: None).save(tmp_path / "path.pt")
    out, llm = fifo_and_expertflow(path, PrefetchConfig("path", file=str(tmp_path / "path.pt")))
    assert out["fifo"] == out["expertflow"]
    assert llm.paths is not None and llm.paths.lookahead_paths > 0
    predictor = llm.prefetcher.predictor
    assert predictor.ahead_missed == 0 and not any(s.ahead for s in predictor._cache.values())
    # a replay of a trace of token strings: the model reads other tokens, and the lookahead reads the trace's (what
    # the pass hands the predictor), so none is wasted
    with TraceReader(tmp_path / "t.mpt") as reader, TraceWriter(tmp_path / "s.mpt", reader.header) as w:
        for r in reader:
            w.add(replace(r, token_ids_T=None, tokens=[f"w{t}" for t in r.token_ids_T.tolist()]))
    llm.replay(ReplaySpec(tmp_path / "s.mpt"), concurrency=6)
    assert llm.paths.lookahead_paths > 0 and predictor.ahead_missed == 0  # (the counts are the call's)
    assert llm.last_stats.sections["token scheduler"].lookahead == llm.paths.lookahead_paths


@pytest.mark.parametrize("deterministic", [True, False])
def test_expertflow_gives_fifos_tokens(hf_checkpoint, deterministic, capsys):
    """Batch-invariant, every request's tokens are FIFO's exactly whatever its group; batched (fp32 tiny model), too.
    Without a predictor it says in one line that it groups by the last token's routing, and the run's statistics
    say where the paths came from."""
    _, path = hf_checkpoint("qwen2_moe")
    prompts = [[3, 11, 5], [7, 1], [2, 2, 9, 4], [5], [8, 6, 1], [4, 4]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    out = {}
    for policy in ("fifo", "expertflow"):
        scheduler = SchedulerConfig(max_num_seqs=2, batch_policy=policy, batch_invariant=deterministic)
        capsys.readouterr()
        llm = LLM(config=EngineConfig(model=str(path), scheduler=scheduler), show_progress=False)
        said = [line for line in capsys.readouterr().err.splitlines() if "batch policy" in line]
        out[policy] = [c.token_ids for c in llm.generate(prompts, params)]
        if policy == "expertflow":
            assert llm.paths is not None and llm.paths.paths == {}  # every finished request forgotten
            assert len(said) == 1 and "last token's routing" in said[0]
            report = llm.last_stats.sections["token scheduler"]
            assert report.lookahead == report.forecast_passes == 0 and report.routed_passes > 0
            assert "grouping paths" in llm.last_stats.table()
        else:
            assert not said and "token scheduler" not in llm.last_stats.sections
    assert out["fifo"] == out["expertflow"]


def test_batch_policy_is_checked():
    from moepager.errors import MoepagerError

    with pytest.raises(MoepagerError, match="unknown --batch-policy"):
        SchedulerConfig(batch_policy="random")  # type: ignore[arg-type]


def test_the_dual_batch_pipeline_forms_the_next_pair_during_the_second_step():
    paths, cluster = clustered(8)
    s = expertflow(4, paths)
    for i in range(8):
        s.add(Tracked(str(i), [1] * 2, request_id=i))
    step(s)  # prompts
    step(s)  # a pair's first step: groups formed now
    policy = s.policy
    assert isinstance(policy, ExpertFlowPolicy)
    assert policy._next is None
    step(s)  # its second step: the next pair's groups are formed on the policy's thread meanwhile
    assert policy._next is not None
    ahead = policy._next.result()
    third = {int(name) for name, *_ in step(s)}
    assert third == set(range(8)) - ahead[1]  # the next pair ran the groups formed ahead
    # formed-ahead groups fitted to who decodes now: finished ones dropped, new ones to the smaller group
    assert ExpertFlowPolicy._fitted(({0, 1, 2}, {3, 4, 5}), [0, 1, 3, 4, 5, 6]) == {3, 4, 5}
    assert ExpertFlowPolicy._fitted(({0, 1, 2}, {3, 4, 5}), [0, 3, 4, 5]) is None  # too far apart: formed again
    s.close()  # the policy's thread stops with the engine
    assert policy._pool is None


@pytest.mark.parametrize("n", [2, 5, 6, 9])
def test_the_exact_split_is_the_least_of_every_balanced_split(n):
    """Against every split enumerated the plain way (either group holding row 0); sizes ceil(n/2), floor(n/2)."""
    import itertools

    rng = np.random.default_rng(n)
    paths = rng.random((n, 40)) < 0.2
    a, b = exact_best_split(paths)
    assert sorted(a + b) == list(range(n)) and len(a) == (n + 1) // 2
    every = [split_cost(paths, g, [i for i in range(n) if i not in g])
             for g in itertools.combinations(range(n), (n + 1) // 2)]
    assert split_cost(paths, a, b) == min(every)
    with pytest.raises(ValueError, match="swap_search"):
        exact_best_split(np.zeros((21, 4), bool))


def test_the_swap_search_ends_where_no_swap_helps_and_never_loses():
    """From 2-means' split: never worse, sizes kept, no single swap of the result lowers the cost, and the exact
    optimum is never worse than it."""
    rng = np.random.default_rng(1)
    for n in (8, 12, 16):
        paths = rng.random((n, 60)) < 0.15
        a0, b0 = balanced_two_means(paths)
        a, b = swap_search(paths, a0, b0)
        assert (len(a), len(b)) == (len(a0), len(b0)) and sorted(a + b) == list(range(n))
        cost = split_cost(paths, a, b)
        assert cost <= split_cost(paths, a0, b0)
        for i in a:
            for j in b:
                swapped_a, swapped_b = [x for x in a if x != i] + [j], [x for x in b if x != j] + [i]
                assert split_cost(paths, swapped_a, swapped_b) >= cost
        assert split_cost(paths, *exact_best_split(paths)) <= cost


def test_on_forecast_probabilities_the_swap_search_lowers_the_expected_distinct_pairs():
    """Paths given as probabilities: the search never raises the expected distinct pairs (1 - prod(1 - p) summed
    per group), keeps the sizes, ends where no swap lowers them; on 0/1 probabilities its objective is the bits'
    distinct pairs, and it ends where no swap lowers those."""
    rng = np.random.default_rng(2)
    for n in (8, 13, 16):
        probs = rng.random((n, 60)) ** 6  # mostly unlikely, a few likely pairs a row
        a0, b0 = balanced_two_means(probs)
        a, b = swap_search(probs, a0, b0)
        assert (len(a), len(b)) == (len(a0), len(b0)) and sorted(a + b) == list(range(n))
        cost = expected_cost(probs, a, b)
        assert cost <= expected_cost(probs, a0, b0) + 1e-9
        for i in a:
            for j in b:
                swapped = [x for x in a if x != i] + [j], [x for x in b if x != j] + [i]
                assert expected_cost(probs, *swapped) >= cost - 1e-6
        bits = probs > 0.3
        assert expected_cost(bits, a, b) == pytest.approx(split_cost(bits, a, b), abs=1e-6)
        a, b = swap_search(bits.astype(np.float32), a0, b0)
        cost = split_cost(bits, a, b)
        assert cost <= split_cost(bits, a0, b0)
        assert all(split_cost(bits, [x for x in a if x != i] + [j], [x for x in b if x != j] + [i]) >= cost
                   for i in a for j in b)


def test_the_engines_grouping_searches_from_two_means_and_reads_mixed_paths_as_probabilities():
    """`group` is 2-means then the swap search; a snapshot that mixes routed bits with a lookahead's probabilities
    is probabilities (the bits as certain), and the grouping keeps a request whose forecast is certain of another
    group's experts with that group."""
    rng = np.random.default_rng(3)
    bits = rng.random((12, 50)) < 0.15
    assert group(bits) == swap_search(bits, *balanced_two_means(bits))
    tracker = PathTracker([0], num_experts=4, top_k=1, lookahead=lambda r, s, t: (
        torch.tensor([[0.0, 0.0, 0.95, 0.9]]) if r == 3 else None))
    info = PassInfo(0, "decode", (0, 1, 2, 3), (5, 5, 5, 5), (1, 1, 1, 1), ("decode",) * 4, torch.tensor([1, 2, 3, 4]))
    tracker.begin_pass(info)
    ids_TK = torch.tensor([[0], [0], [2], [0]])
    tracker.routed(0, torch.zeros(4, 2), RoutingDecision(ids_TK, ids_TK.float(), ids_TK.float(), ids_TK), ())
    tracker.update([Decoding(i, [1, 2, 3, 4, 5, 6]) for i in range(4)])
    policy = ExpertFlowPolicy(SchedulerConfig(max_num_seqs=2), tracker)
    snapshot = policy._snapshot([0, 1, 2, 3])
    assert snapshot.dtype == np.float32 and snapshot[0].tolist() == [1, 0, 0, 0]
    # request 3 routed expert 0 last, but its next token is forecast at experts 2 and 3: it joins request 2
    assert ExpertFlowPolicy._groups([0, 1, 2, 3], snapshot) == ({0, 1}, {2, 3})
