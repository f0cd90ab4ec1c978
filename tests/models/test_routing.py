"""Routing observers: what they stage comes to the host with the routed ids, in one copy per MoE layer."""

from __future__ import annotations

import torch

import moepager.models.routing as routing
from moepager.config import PrefetchConfig, StoreConfig
from moepager.models.moe import SoftmaxTopKRouter
from moepager.models.routing import RoutingFanOut, observe
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from moepager.types import to_host


class Staging:
    """Stages its own tensors and records what `routed` got back."""

    def __init__(self, *staged: torch.Tensor):
        self.staged = staged
        self.seen: list[tuple[torch.Tensor | None, list[torch.Tensor]]] = []

    def stage(self, layer, x_ND, route):  # noqa: ANN001, ANN201
        return self.staged

    def routed(self, layer, x_ND, route, staged):  # noqa: ANN001, ANN201
        self.seen.append((route.ids_host_TK, list(staged)))


def counting(monkeypatch) -> list[int]:  # noqa: ANN001
    """Patches the routing module's host copy to count its calls (the number of tensors of each)."""
    calls: list[int] = []

    def counted(*tensors: torch.Tensor) -> list[torch.Tensor]:
        calls.append(len(tensors))
        return to_host(*tensors)
    monkeypatch.setattr(routing, "to_host", counted)
    return calls


def test_a_fan_out_hands_each_observer_its_own_staged_tensors_from_one_copy(monkeypatch):
    calls = counting(monkeypatch)
    gate = SoftmaxTopKRouter(8, 4, 2, normalize=True, fp32_weights=False)
    torch.nn.init.normal_(gate.weight)
    x_ND = torch.randn(3, 8)
    route = gate(x_ND)
    a, b, c = Staging(torch.ones(2)), Staging(), Staging(torch.zeros(1), torch.arange(3))
    routed = observe(RoutingFanOut([a, b, c]), 0, x_ND, route)
    assert calls == [4]  # the ids and the three staged tensors, together
    assert torch.equal(routed.ids_host_TK, route.ids_TK)
    assert [len(s) for _, s in a.seen + b.seen + c.seen] == [1, 0, 2]
    assert torch.equal(a.seen[0][1][0], torch.ones(2)) and torch.equal(c.seen[0][1][1], torch.arange(3))
    assert all(ids is routed.ids_host_TK for ids, _ in a.seen + b.seen + c.seen)
    observe(a, 0, x_ND, routed)  # ids already on the host: only the staged tensor is copied
    assert calls == [4, 1]


def test_a_recorded_and_predicted_paged_layer_copies_to_the_host_once(hf_checkpoint, monkeypatch, tmp_path):
    """The trace recorder (weights, scores, hidden states) and gate lookahead (its forecast) share the block's one
    copy: a call per MoE layer and pass, whatever the observers read, and the outputs stay the resident ones."""
    _, path = hf_checkpoint("olmoe")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    reference = LLM(path, show_progress=False).generate([[5, 9, 2, 40]], params)[0].token_ids
    llm = LLM(path, show_progress=False, store=StoreConfig(expert_memory="50%", direct_io="off", warm=False),
              prefetch=PrefetchConfig("gate-lookahead", distance=1))
    calls = counting(monkeypatch)
    got = llm.generate([[5, 9, 2, 40]], params, record_trace=tmp_path / "t.mpt", record_hidden=True)[0].token_ids
    assert got == reference
    passes = 6  # one prefill pass and five decode passes
    assert len(calls) == passes * llm.loaded.config.num_moe_layers
    assert set(calls) == {5}  # ids; the recorder's weights, scores and hidden states; the forecast
    assert llm.last_stats.sections["experts"].phases["decode"]["loads_ahead"] > 0
