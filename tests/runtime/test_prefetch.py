"""Prefetch in the engine: every predictor loads experts ahead, and outputs stay those of the all-resident run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moepager.cli.main import main
from moepager.config import EngineConfig, PlacementConfig, PrefetchConfig, StoreConfig
from moepager.errors import MoepagerError
from moepager.predictors import token_keys
from moepager.predictors.expert_map import hashed_tokens, prefix_means
from moepager.predictors.oracle import ReplayOracle
from moepager.runtime.builder import check_names
from moepager.runtime.llm import LLM
from moepager.runtime.replay import ReplaySpec
from moepager.runtime.sampling import SamplingParams
from moepager.trace.fit import FITTERS, HeadFit, PathFit, fit_expert_maps, fit_token_wise, fit_transition
from moepager.trace.format import DECODE, PREFILL, TraceHeader, TraceReader, TraceRequest, TraceWriter

PROMPTS = [[5, 9, 2, 40, 41], [7, 1, 3]]
PARAMS = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def recorded(hf_checkpoint, tmp_path_factory):
    """The olmoe tiny model, its all-resident outputs, and predictor files fitted on a trace it recorded."""
    _, path = hf_checkpoint("olmoe")
    out = tmp_path_factory.mktemp("prefetch")
    llm = LLM(path, show_progress=False)
    reference = [c.token_ids for c in llm.generate(PROMPTS, PARAMS)]
    llm.generate([[3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13]], SamplingParams(max_tokens=30, temperature=1.0, seed=1,
                 ignore_eos=True), record_trace=out / "t.mpt", record_hidden=True)
    with TraceReader(out / "t.mpt") as reader:
        everything = list(range(len(reader)))
        fit_transition(reader, everything, [1, 2, 3]).save(out / "transition.pt")
        fit_expert_maps(reader, everything, capacity=50).save(out / "expert-map.pt")
        fit_token_wise(reader, everything, epochs=50).save(out / "token-wise.pt")
        num_layers = reader.header.num_layers
        for name, options in (("head", HeadFit(distances=(1, num_layers), epochs=2)), ("path", PathFit(epochs=2))):
            FITTERS[name].fit(reader, everything, options, lambda advance: None).save(out / f"{name}.pt")
    return path, reference, out


@pytest.mark.parametrize("predictor, fitted, scope", [
    ("gate-lookahead", False, "layer"), ("transition", True, "layer"), ("expert-map", True, "layer"),
    ("expert-map", False, "global"), ("token-wise", True, "layer"), ("gate-lookahead", False, "global"),
    ("head", True, "layer"), ("path", True, "layer"), ("path", True, "global")])
def test_every_predictor_prefetches_without_changing_outputs(recorded, predictor, fitted, scope):
    path, reference, files = recorded
    llm = LLM(path, show_progress=False,
              store=StoreConfig(expert_memory="50%", direct_io="off", scope=scope, warm=False),
              prefetch=PrefetchConfig(predictor, file=str(files / f"{predictor}.pt") if fitted else None,
                                      learn=not fitted))
    assert [c.token_ids for c in llm.generate(PROMPTS, PARAMS)] == reference
    phases = llm.last_stats.sections["experts"].phases
    assert phases["decode"]["loads_ahead"] > 0

    def total(field: str) -> int:  # a prefetch issued at the end of prefill is judged in decode
        return sum(p[field] for p in phases.values())
    judged = total("prefetch_used") + total("prefetch_wasted") + total("prefetch_cancelled")
    assert judged <= total("loads_ahead") <= judged + 2 * len(PROMPTS) * llm.loaded.config.top_k * 3


def test_gate_lookahead_hides_loads_on_a_deepseek_style_model(hf_checkpoint):
    _, path = hf_checkpoint("deepseek_v3")
    reference = [c.token_ids for c in LLM(path, show_progress=False).generate(PROMPTS, PARAMS)]
    llm = LLM(path, show_progress=False, store=StoreConfig(expert_memory="50%", direct_io="off", warm=False),
              prefetch=PrefetchConfig("gate-lookahead", distance=1))
    assert [c.token_ids for c in llm.generate(PROMPTS, PARAMS)] == reference
    decode = llm.last_stats.sections["experts"].phases["decode"]
    assert decode["prefetch_used"] > 0


def test_recorded_hidden_states_are_the_router_inputs(recorded):
    path, _, files = recorded
    llm = LLM(path, show_progress=False)
    with TraceReader(files / "t.mpt") as reader:
        request = reader.request(0)
    assert request.hidden_TLD is not None and request.hidden_TLD.dtype == np.float16
    gates = [block.gate for block in llm.loaded.model.moe_blocks()]
    for layer, gate in enumerate(gates):
        x = torch.from_numpy(request.hidden_TLD[:, layer].astype(np.float32))
        ids = gate(x).ids_TK.sort(-1).values.numpy()
        agree = (ids == np.sort(request.ids_TLK[:, layer], -1)).all(-1).mean()
        assert agree > 0.9  # float16 storage may flip a near tie


def test_prefetch_needs_a_paged_store_and_a_fitted_file(recorded):
    path, _, files = recorded
    with pytest.raises(MoepagerError, match="--expert-memory"):  # never fitted: nothing to prefetch into
        EngineConfig(model=str(path), prefetch=PrefetchConfig("gate-lookahead"),
                     placement=PlacementConfig(execution="cpu-experts"))
    with pytest.raises(MoepagerError, match="moepager predictor fit"):
        LLM(path, show_progress=False, store=StoreConfig(expert_memory="50%", direct_io="off"),
            prefetch=PrefetchConfig("token-wise"))
    with pytest.raises(MoepagerError, match="unknown predictor"):  # checked where the engine is built
        check_names(EngineConfig(store=StoreConfig(expert_memory="50%"), prefetch=PrefetchConfig("oracle")))


def test_generate_cli_prints_prefetch_statistics(demo_checkpoint, capsys):
    assert main(["generate", "--model", str(demo_checkpoint), "--quiet", "--expert-memory", "50%", "--cold",
                 "--predictor", "gate-lookahead", "--max-tokens", "8", "--ignore-eos", "hello"]) == 0
    out = capsys.readouterr().out
    assert "decode prefetch" in out and "accuracy" in out
    assert main(["generate", "--model", str(demo_checkpoint), "--execution", "cpu-experts", "--predictor",
                 "gate-lookahead", "hello"]) == 2
    assert "--expert-memory" in capsys.readouterr().err
    assert main(["generate", "--model", str(demo_checkpoint), "--quiet", "--predictor", "gate-lookahead",
                 "--max-tokens", "2", "hello"]) == 0  # no budget: the fit decides (all resident here, said so)
    assert "--predictor gate-lookahead unused: nothing is paged" in capsys.readouterr().out


def test_a_runs_statistics_say_what_the_prefetcher_cost_the_forward_thread(recorded, demo_checkpoint, capsys):
    """fMoE matches maps inline (its paper decouples the matcher onto threads, §2.9): each run says how long the
    forward thread spent in the prefetcher, per phase, counted afresh each call."""
    path, reference, files = recorded
    llm = LLM(path, show_progress=False, store=StoreConfig(expert_memory="50%", direct_io="off", warm=False),
              prefetch=PrefetchConfig("expert-map", file=str(files / "expert-map.pt")))
    for _ in range(2):  # the second call's counts are its own
        assert [c.token_ids for c in llm.generate(PROMPTS, PARAMS)] == reference
        cost = llm.last_stats.sections["prefetch"].to_dict()
        assert cost["predictor"] == "expert-map"
        assert cost["passes"]["decode"] == 15 and cost["passes"]["prefill"] >= 1  # 2 rows a pass, 16 tokens each
        assert cost["inline_s"]["decode"] > 0 and cost["inline_s"]["prefill"] > 0
        assert 0 < cost["decode_share"] < 1
    assert main(["generate", "--model", str(demo_checkpoint), "--quiet", "--expert-memory", "50%", "--cold",
                 "--predictor", "gate-lookahead", "--max-tokens", "8", "--ignore-eos", "hello"]) == 0
    assert "prefetcher (gate-lookahead) on the forward thread" in capsys.readouterr().out


def test_the_plain_prefetch_policy_is_lossless_and_cancels_nothing(recorded):
    path, reference, files = recorded
    llm = LLM(path, show_progress=False,
              store=StoreConfig(expert_memory="50%", direct_io="off", warm=False, prefetch_policy="plain"),
              prefetch=PrefetchConfig("transition", file=str(files / "transition.pt")))
    assert [c.token_ids for c in llm.generate(PROMPTS, PARAMS)] == reference
    phases = llm.last_stats.sections["experts"].phases.values()
    assert sum(p["loads_ahead"] for p in phases) > 0 and sum(p["prefetch_cancelled"] for p in phases) == 0


def test_fmoe_eviction_with_expert_map_forecasts_is_lossless(recorded):
    path, reference, files = recorded
    llm = LLM(path, show_progress=False,
              store=StoreConfig(expert_memory="50%", direct_io="off", policy="fmoe", warm=False),
              prefetch=PrefetchConfig("expert-map", file=str(files / "expert-map.pt")))
    assert [c.token_ids for c in llm.generate(PROMPTS, PARAMS)] == reference
    policy = llm.loaded.experts.store.order.inner
    assert not np.isnan(policy.stats.prob[: len(policy._index)]).all()  # the forecasts reached the policy


def test_plec_eviction_ranks_by_the_heads_next_token_forecasts_and_is_lossless(recorded):
    path, reference, files = recorded
    llm = LLM(path, show_progress=False,
              store=StoreConfig(expert_memory="50%", direct_io="off", policy="plec", warm=False),
              prefetch=PrefetchConfig("head", file=str(files / "head.pt"), per_row=1))
    assert [c.token_ids for c in llm.generate(PROMPTS, PARAMS)] == reference
    prefetcher = llm.loaded.prefetcher if hasattr(llm.loaded, "prefetcher") else None
    policy = llm.loaded.experts.store.order.inner
    assert type(policy).__name__ == "PLEC" and (prefetcher is None or prefetcher.next_use)
    assert not np.isnan(policy.stats.prob[: len(policy._index)]).all()  # the forecasts reached the policy


def test_forecasts_can_rank_evictions_without_prefetching(recorded):
    path, reference, files = recorded
    llm = LLM(path, show_progress=False,
              store=StoreConfig(expert_memory="50%", direct_io="off", policy="plec", warm=False),
              prefetch=PrefetchConfig("head", file=str(files / "head.pt"), per_row=0))
    assert [c.token_ids for c in llm.generate(PROMPTS, PARAMS)] == reference
    phases = llm.last_stats.sections["experts"].phases
    assert sum(p["loads_ahead"] for p in phases.values()) == 0
    policy = llm.loaded.experts.store.order.inner
    assert not np.isnan(policy.stats.prob[: len(policy._index)]).all()
    with pytest.raises(MoepagerError, match="--prefetch-k must be >= 0"):
        PrefetchConfig("head", per_row=-1)


def test_predict_eval_runs_model_predictors_on_a_recorded_trace(recorded, capsys):
    path, _, files = recorded
    assert main(["predict-eval", "--trace", str(files / "t.mpt"), "--predictor", "gate-lookahead,token-wise",
                 "--model", str(path), "--distance", "1,3", "--test-fraction", "0.34"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {tuple(line.split()[:2]) for line in lines if line.startswith(("gate-lookahead", "token-wise"))}
    assert rows == {("gate-lookahead", "1"), ("gate-lookahead", "3"), ("token-wise", "1"), ("token-wise", "3")}


def test_the_replay_oracle_prefetches_exactly_the_replayed_routing(recorded, tmp_path):
    """replay-oracle forecasts what the trace recorded (the upper bound of any predictor): a replay with it
    decodes the resident replay's tokens, every expert it loads ahead is used, and it misses less than LRU alone
    at the same budget; outside a replay it is refused, in the engine and in offline evaluation."""
    path, _, files = recorded
    spec = ReplaySpec(files / "t.mpt")
    want = [c.token_ids for c in LLM(path, show_progress=False).replay(spec)]
    store = StoreConfig(expert_memory="50%", direct_io="off", warm=False)
    lru = LLM(path, show_progress=False, store=store)
    assert [c.token_ids for c in lru.replay(spec)] == want
    oracle = LLM(path, show_progress=False, store=store, prefetch=PrefetchConfig("replay-oracle"))
    assert [c.token_ids for c in oracle.replay(spec)] == want
    decode = oracle.last_stats.sections["experts"].phases["decode"]
    assert decode["loads_ahead"] > 0 and decode["prefetch_wasted"] == 0
    assert decode["hit_rate"] > lru.last_stats.sections["experts"].phases["decode"]["hit_rate"]
    with pytest.raises(MoepagerError, match="replay-oracle forecasts the routing a replay runs"):
        oracle.generate(PROMPTS, PARAMS)
    assert oracle.prefetcher is not None and oracle.prefetcher.predictor.source is None  # unbound after the replay
    assert main(["predict-eval", "--trace", str(files / "t.mpt"), "--predictor", "replay-oracle"]) == 2


def test_the_semantic_embedding_is_the_models_embedding_looked_up_on_the_host():
    """expert-map's prompt embedding: the rows the model's own embedding gives, read on the host where the pass's
    token ids are (a CUDA model's table is copied there once: no device round trip before the first layer)."""
    from moepager.runtime.prefetch import _embedding

    table = torch.nn.Embedding(50, 8, dtype=torch.bfloat16)
    ids = torch.tensor([3, 0, 49, 3])
    got = _embedding(table)(ids)
    assert got.device.type == "cpu" and torch.equal(got, table(ids).detach())


def test_a_wider_prefetch_lane_keeps_outputs_and_takes_its_read_buffers_from_the_budget(recorded):
    path, reference, _ = recorded

    def run(threads: int) -> LLM:
        return LLM(path, show_progress=False, prefetch=PrefetchConfig("gate-lookahead"),
                   store=StoreConfig(expert_memory="50%", direct_io="off", warm=False, prefetch_threads=threads))
    wide, narrow = run(3), run(1)
    assert [c.token_ids for c in wide.generate(PROMPTS, PARAMS)] == reference
    stores = wide.loaded.experts.store, narrow.loaded.experts.store
    assert [s.transfers.ahead_pool._max_workers for s in stores] == [3, 1]
    assert stores[0].read_buffer_bytes * 5 == stores[1].read_buffer_bytes * 7  # 4 I/O threads + 3, against + 1


@pytest.mark.parametrize("flags, yields", [([], True), (["--prefetch-no-yield"], False)], ids=["yield", "no-yield"])
def test_prefetches_that_give_way_to_demand_loads_or_not_keep_outputs(recorded, flags, yields):
    """`--prefetch-no-yield` reaches the store's transfer lanes; either way a two-thread prefetch lane, whose reads
    give way between chunks, are promoted and abandoned as layers route, leaves the tokens as they were."""
    import argparse
    from dataclasses import replace

    from moepager.cli.generate import add_arguments, store_config

    path, reference, _ = recorded
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(path), "--expert-memory", "50%", "--direct-io", "off",
                              "--predictor", "gate-lookahead", "--prefetch-threads", "2", *flags, "hi"])
    config = store_config(args)
    assert config.prefetch_yields is yields
    llm = LLM(path, show_progress=False, prefetch=PrefetchConfig("gate-lookahead"), store=replace(config, warm=False))
    assert [c.token_ids for c in llm.generate(PROMPTS, PARAMS)] == reference
    assert llm.loaded.experts.store.transfers.yields is yields


def test_the_head_prefetches_one_expert_a_row_at_a_floor_of_one_half_unless_told_otherwise(recorded):
    """A predictor's own defaults for --prefetch-k and --prefetch-min-p (the head's: the setting measured best on
    replayed real routing); the options override them, and other predictors keep top-k and no floor."""
    path, _, files = recorded
    store = StoreConfig(expert_memory="50%", direct_io="off", warm=False)

    def plan(name: str, **given) -> tuple[int, float]:
        file = str(files / f"{name}.pt") if name != "gate-lookahead" else None
        llm = LLM(path, show_progress=False, store=store, prefetch=PrefetchConfig(name, file=file, **given))
        return llm.prefetcher.plan.per_row, llm.prefetcher.plan.min_p
    top_k = LLM(path, show_progress=False).loaded.model.config.top_k
    assert plan("head") == (1, 0.5)
    assert plan("head", per_row=3, min_p=0.0) == (3, 0.0)
    assert plan("transition") == plan("gate-lookahead") == (top_k, 0.0)


def test_a_probability_floor_keeps_only_the_experts_forecast_at_least_that_likely():
    """`--prefetch-min-p`: of a row's selected experts (top 3 here), those under the floor are not queued."""
    from types import SimpleNamespace

    from moepager.predictors import Forecast
    from moepager.runtime.prefetch import Prefetcher, PrefetchPlan

    store = SimpleNamespace(quota=lambda layer: 4)
    queued = {}
    for floor in (0.0, 0.5):
        prefetcher = Prefetcher(SimpleNamespace(), store, [0, 1], PrefetchPlan(1, 3, 8, floor))
        prefetcher._enqueue(Forecast(torch.tensor([[0.9, 0.05, 0.6, 0.45, 0.0], [0.2, 0.7, 0.0, 0.3, 0.1]])), 1, 0)
        queued[floor] = prefetcher.pending[(0, 1)]
    assert queued[0.0] == pytest.approx({0: 1.1, 1: 0.7, 2: 0.6, 3: 0.75})
    assert queued[0.5] == pytest.approx({0: 0.9, 1: 0.7, 2: 0.6})


def test_a_floor_prefetches_less_and_keeps_outputs(recorded):
    path, reference, files = recorded

    def loads_ahead(floor: float) -> int:
        llm = LLM(path, show_progress=False, store=StoreConfig(expert_memory="50%", direct_io="off", warm=False),
                  prefetch=PrefetchConfig("head", file=str(files / "head.pt"), min_p=floor))
        assert [c.token_ids for c in llm.generate(PROMPTS, PARAMS)] == reference
        return sum(p["loads_ahead"] for p in llm.last_stats.sections["experts"].phases.values())
    assert loads_ahead(0.9) < loads_ahead(0.0)


def test_a_replay_hands_the_predictor_the_recorded_tokens(recorded, tmp_path):
    """In a replay the predictor reads the trace's tokens, not the model's (its prompt ids stand in for them and
    it samples its own continuation): strings as fitting hashes them (token_keys), and a hashed-token semantic
    embedding over the recorded strings; after the replay the model's own ids again."""
    path, _, files = recorded
    tokens = [[f"w{t % 4}" for t in range(7)], ["x", "y", "z", "x", "y"]]
    header = TraceHeader("tiny", (1, 2, 3), 8, 2, expert_bytes=1 << 20)
    rng = np.random.default_rng(0)
    with TraceWriter(tmp_path / "t.mpt", header) as w:
        for r, words in enumerate(tokens):
            ids = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(3)]) for _ in words])
            w.add(TraceRequest(ids.astype(np.int16), np.array([PREFILL] * 3 + [DECODE] * (len(words) - 3), np.uint8),
                               name=f"r{r}", tokens=words))
    llm = LLM(path, show_progress=False, store=StoreConfig(expert_memory="50%", direct_io="off", warm=False),
              prefetch=PrefetchConfig("expert-map", file=str(files / "expert-map.pt")))
    predictor = llm.prefetcher.predictor
    assert predictor.semantic == "hashed-tokens"
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    start = predictor.start_iteration
    predictor.start_iteration = lambda ids_N, sem_ND: (seen.append((ids_N, sem_ND)), start(ids_N, sem_ND))[1]
    llm.replay(ReplaySpec(tmp_path / "t.mpt"))
    assert torch.cat([ids for ids, _ in seen]).tolist() == token_keys(tokens[0] + tokens[1]).tolist()
    sem = torch.cat([s for _, s in seen])
    assert torch.allclose(sem[:7], prefix_means(hashed_tokens(tokens[0])))
    assert torch.allclose(sem[7:], prefix_means(hashed_tokens(tokens[1])))
    seen.clear()
    llm.generate(PROMPTS[:1], PARAMS)
    assert seen[0][0].tolist() == PROMPTS[0]


def test_the_oracles_forecast_is_certain():
    """Each recorded expert gets probability 1 (it will be used): any probability floor keeps it."""
    class Recorded:
        def recorded(self, column: int, ahead: int) -> torch.Tensor:
            return torch.tensor([[1, 3], [2, -1]])
    oracle = ReplayOracle(4)
    oracle.bind(Recorded())
    assert oracle.forecast(0, 0).probs_NE.tolist() == [[0, 1, 0, 1], [0, 0, 1, 0]]


def test_fixed_n_walks_past_the_cached_experts_and_adaptive_n_does_not():
    """SMoE §2.7: with experts 0 and 1 cached, Fixed-N (N = 2) names the ranking down to its second uncached expert
    (3), so two loads are issued; Adaptive-N names the top 2, both cached, and loads none. The choice is made once:
    pumping again issues nothing new."""
    from types import SimpleNamespace

    from moepager.predictors import Forecast
    from moepager.runtime.prefetch import Prefetcher, PrefetchPlan

    issued: list[list[tuple[int, int]]] = []
    store = SimpleNamespace(quota=lambda layer: 3, cached=lambda layer: {0, 1}, prefetches_in_flight=lambda: 0,
                            prefetch_ranked=lambda wanted, limit: issued.append(list(wanted)) or 0)
    forecast = Forecast(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04, 0.0], [0.0, 0.6, 0.3, 0.1, 0.0, 0.0]]))
    queued = {}
    for fixed in (True, False):
        prefetcher = Prefetcher(SimpleNamespace(), store, [0, 1], PrefetchPlan(1, 2, 8, 0.0, fixed))
        prefetcher._enqueue(forecast, 1, 0)
        queued[fixed] = prefetcher.pending[(0, 1)]
    assert queued[True] == pytest.approx({0: 0.5, 1: 0.9, 2: 0.4, 3: 0.16})  # row 2: 1 cached, then 2 and 3
    assert queued[False] == pytest.approx({0: 0.5, 1: 0.9, 2: 0.3})
    prefetcher = Prefetcher(SimpleNamespace(), store, [0, 1], PrefetchPlan(1, 2, 8, 0.0, True))
    prefetcher._enqueue(forecast, 1, 0)
    prefetcher._pump()
    prefetcher._pump()
    assert issued[0] == issued[1] == [(1, 1), (1, 0), (1, 2), (1, 3)]  # not cut at the quota of 3: 0 and 1 are held


def test_fixed_n_loads_more_ahead_than_adaptive_n_and_keeps_outputs(recorded):
    path, reference, files = recorded

    def loads_ahead(fixed: bool) -> int:
        llm = LLM(path, show_progress=False, store=StoreConfig(expert_memory="50%", direct_io="off", warm=False),
                  prefetch=PrefetchConfig("token-wise", file=str(files / "token-wise.pt"), per_row=1, fixed=fixed))
        assert llm.prefetcher.plan.fixed is fixed
        assert [c.token_ids for c in llm.generate(PROMPTS, PARAMS)] == reference
        return sum(p["loads_ahead"] for p in llm.last_stats.sections["experts"].phases.values())
    assert loads_ahead(True) > loads_ahead(False)
    with pytest.raises(MoepagerError, match="--prefetch-k 0 loads none"):
        LLM(path, show_progress=False, store=StoreConfig(expert_memory="50%"),
            prefetch=PrefetchConfig("token-wise", file=str(files / "token-wise.pt"), per_row=0, fixed=True))


def test_flex_turns_prefetch_off_at_the_least_accurate_half_of_the_layers():
    """SMoE-Flex §2.8: forecasts for positions 0-3 pick experts routed 1, 0, 2 and 1 of 2 times; once judged, the
    two least accurate (1, and 3 before 0 on a tie) prefetch nothing, and the others go on."""
    from types import SimpleNamespace

    from moepager.predictors import Forecast
    from moepager.runtime.prefetch import Prefetcher, PrefetchPlan

    store = SimpleNamespace(quota=lambda layer: 4)
    prefetcher = Prefetcher(SimpleNamespace(), store, [0, 1, 2, 3], PrefetchPlan(1, 2, 8, 0.0, flex=True))
    forecast = Forecast(torch.tensor([[0.5, 0.3, 0.1, 0.1]]))  # picks experts 0 and 1
    for j in range(4):
        prefetcher._enqueue(forecast, j, 0)
    for i, routed in enumerate(([0, 2], [2, 3], [1, 0], [3, 1])):
        prefetcher.judge(i, routed)
    assert prefetcher.judged == [[1, 2], [0, 2], [2, 2], [1, 2]]
    prefetcher.choose_flex()
    assert prefetcher.flex_off == {1, 3} and not prefetcher.flex_judging
    prefetcher.pending = {}
    for j in range(4):
        prefetcher._enqueue(forecast, j, 0)
    assert sorted(j for _, j in prefetcher.pending if prefetcher.pending[(0, j)]) == [0, 2]


def test_flex_chooses_its_layers_in_a_run_prefetches_less_and_keeps_outputs(recorded, monkeypatch):
    import moepager.runtime.prefetch as prefetch

    monkeypatch.setattr(prefetch, "FLEX_PASSES", 4)
    path, reference, files = recorded

    def run(flex: bool) -> tuple[int, LLM]:
        llm = LLM(path, show_progress=False, store=StoreConfig(expert_memory="50%", direct_io="off", warm=False),
                  prefetch=PrefetchConfig("token-wise", file=str(files / "token-wise.pt"), flex=flex))
        assert [c.token_ids for c in llm.generate(PROMPTS, PARAMS)] == reference
        return sum(p["loads_ahead"] for p in llm.last_stats.sections["experts"].phases.values()), llm
    flexed, llm = run(True)
    layers = len(llm.prefetcher.moe_layers)
    assert not llm.prefetcher.flex_judging and len(llm.prefetcher.flex_off) == layers // 2 >= 1
    assert flexed < run(False)[0]
