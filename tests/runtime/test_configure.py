"""`--configure auto`: MoEpic's configurator online changes per-layer cache sizes (and split ratios) as the engine
runs, and no token changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moepager.checkpoints.split import split_checkpoint
from moepager.cli.main import main
from moepager.config import PrefetchConfig, StoreConfig
from moepager.errors import MoepagerError
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from moepager.types import PassInfo, RoutingDecision
from tests.conftest import expert_budget

PROMPTS = [[5, 17, 42, 8, 63, 2], [7, 1, 30]]
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_reconfiguring_every_few_tokens_changes_the_caches_and_no_token(hf_checkpoint, tmp_path, split):
    _, path = hf_checkpoint("olmoe")
    if split:
        path = split_checkpoint(path, tmp_path / "s4", 4, show_progress=False)
    ref = tokens(LLM(path, show_progress=False))
    nbytes = LLM(path, show_progress=False).loaded.expert_shape.nbytes
    parts = 4 if split else 1
    store = StoreConfig(expert_memory=expert_budget(nbytes, 12 * parts), configure="auto", configure_every=6)
    llm = LLM(path, store=store, show_progress=False)
    assert tokens(llm) == ref
    configurator = llm.configurator
    assert configurator is not None and configurator.changes  # it did move budget between layers
    table = llm.store.device.table
    assert sum(table.quota.values()) == table.capacity
    assert all(len(table.by_layer[layer]) <= table.quota[layer] for layer in table.quota)
    if split:
        assert all(k.expert % 4 < llm.store.space.tops[k.layer] for k in table.slot_of)
        assert "top parts" in configurator.changes[0] and "top parts 2 2 2 -> " in configurator.changes[0]
    unmoved = LLM(path, store=StoreConfig(expert_memory=expert_budget(nbytes, 12 * parts), configure="auto",
                                          configure_every=10**6), show_progress=False)
    assert tokens(unmoved) == ref and not unmoved.configurator.changes
    # MoEpic's outer loop starts at θ = 0.5: half of each expert's parts cached until the first change
    assert set(getattr(unmoved.store.space, "tops", {}).values()) == ({2} if split else set())


def test_the_window_keeps_the_most_recent_decode_tokens_oldest_first():
    from moepager.runtime.configure import OnlineConfigurator

    class Store:  # what the window needs of a store: nothing until a reconfiguration
        parts = 1

    online = OnlineConfigurator(Store(), [0, 1], num_experts=4, top_k=1, costs=None, every=100, window=3)  # type: ignore[arg-type]
    for step in range(5):  # decode passes of one token; a prefill pass in between is not recorded
        phase = "prefill" if step == 2 else "decode"
        online.begin_pass(PassInfo(step, phase, (0,), (step,), (1,), (phase,), torch.tensor([0])))
        for layer in (0, 1):
            ids = torch.tensor([[step % 4]])
            online.routed(layer, torch.zeros(1, 2), RoutingDecision(ids, ids.float(), ids.float(), ids), ())
    online.begin_pass(PassInfo(5, "decode", (0,), (5,), (1,), ("decode",), torch.tensor([0])))
    assert online.recent()[:, 0, 0].tolist() == [1, 3, 0]  # steps 1, 3 and 4 (4 % 4 = 0); step 2 was a prefill
    assert np.array_equal(online.recent()[:, 0], online.recent()[:, 1])


def test_the_forecasts_the_prefetcher_acts_on_are_ranked_against_the_tokens_they_forecast():
    from moepager.runtime.configure import OnlineConfigurator

    class Store:
        parts = 1

    online = OnlineConfigurator(Store(), [0, 1], num_experts=4, top_k=1, costs=None, every=100, window=8, ranked=2)  # type: ignore[arg-type]
    forecast = torch.tensor([[0.1, 0.6, 0.0, 0.3]])  # ranked 1, 3; experts 0 and 2 are not among its top 2
    for step in range(3):
        online.begin_pass(PassInfo(step, "decode", (0,), (step,), (1,), ("decode",), torch.tensor([0])))
        if step == 0:
            online.predicted(0, 0, forecast)
            online.predicted(0, 1, torch.tensor([[0.0, 0.0, 0.0, 0.9]]))  # one expert with a chance: rank 2 is none
        if step == 1:
            online.predicted(1, 0, torch.cat([forecast, forecast]))  # two rows for a pass of one token: no match
        # step 2: a forecast made for a later pass does not rank this one
        if step == 2:
            online.predicted(3, 0, forecast)
        for layer in (0, 1):
            ids = torch.tensor([[1]])
            online.routed(layer, torch.zeros(1, 2), RoutingDecision(ids, ids.float(), ids.float(), ids), ())
    online.begin_pass(PassInfo(3, "decode", (0,), (3,), (1,), ("decode",), torch.tensor([0])))
    ranks = online.recent(ranks=True)
    assert ranks.shape == (3, 2, 2)
    assert ranks[0].tolist() == [[1, 3], [3, -1]]
    assert ranks[1].tolist() == [[-1, -1], [-1, -1]] and ranks[2].tolist() == [[-1, -1], [-1, -1]]
    assert (3, 0) in online.forecasts  # kept for the pass it forecasts
    online.begin_pass(PassInfo(4, "decode", (0,), (4,), (1,), ("decode",), torch.tensor([0])))
    assert not online.forecasts  # that pass went by without layer 0 routing: dropped


def test_with_a_predictor_the_configurator_models_prefetch_from_its_forecasts(hf_checkpoint):
    _, path = hf_checkpoint("olmoe")
    ref = tokens(LLM(path, show_progress=False))
    nbytes = LLM(path, show_progress=False).loaded.expert_shape.nbytes
    store = StoreConfig(expert_memory=expert_budget(nbytes, 12), configure="auto", configure_every=6)
    llm = LLM(path, store=store, prefetch=PrefetchConfig("gate-lookahead"), show_progress=False)
    assert tokens(llm) == ref
    online = llm.configurator
    assert online is not None and online.ranked == llm.prefetcher.plan.per_row > 0
    ranks = online.recent(ranks=True)
    assert ranks.shape[2] == online.ranked and (ranks >= 0).any()  # forecasts met the tokens they forecast
    assert online.changes and all("prefetch modeled from forecasts naming" in line for line in online.changes)
    plain = LLM(path, store=store, show_progress=False).configurator
    assert plain.ranked == 0 and plain.recent(ranks=True).shape[2] == 0


def test_configure_options_are_checked(demo_checkpoint, capsys):
    with pytest.raises(MoepagerError, match="--configure auto sizes each layer's share"):
        StoreConfig(configure="auto")
    with pytest.raises(MoepagerError, match="--configure-every must be >= 1"):
        StoreConfig(expert_memory="50%", configure="auto", configure_every=0)
    assert main(["generate", "--model", str(demo_checkpoint), "--configure-every", "10", "Hi"]) == 2
    assert "--configure-every does nothing without --configure auto" in capsys.readouterr().err
    args = ["generate", "--model", str(demo_checkpoint), "--expert-memory", "50%", "--configure", "auto",
            "--execution", "hybrid", "Hi"]
    assert main(args) == 2
    assert "--configure auto sizes the expert store's per-layer caches" in capsys.readouterr().err
