"""The operator a compiled step leaves its graph through (models/graph_exit.py): it runs the registered block's host
step on the routing it is handed, traces as an opaque op with x's shape, and its handles are small counters (the
same in every process, so Inductor's cache on disk finds a recompiled graph), held weakly."""

from __future__ import annotations

import gc

import pytest
import torch

from moepager.models import graph_exit
from moepager.types import RoutingDecision


class Doubling:
    def __init__(self) -> None:
        self.routes: list[RoutingDecision] = []

    def host_step(self, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        self.routes.append(route)
        return 2 * x_ND + route.weights_TK.sum()


def test_the_operator_runs_the_registered_host_step_on_the_routing_it_is_given():
    block = Doubling()
    handle = graph_exit.register(block)
    x, ids, w, scores = torch.ones(1, 4), torch.tensor([[1, 3]]), torch.tensor([[0.25, 0.5]]), torch.rand(1, 5)
    out = graph_exit.moe_layer(x, ids, w, scores, handle)
    assert torch.equal(out, torch.full((1, 4), 2.75))
    route = block.routes[0]
    assert torch.equal(route.ids_TK, ids) and torch.equal(route.weights_TK, w) and torch.equal(route.scores_TE, scores)


def test_a_compiled_graph_calls_the_operator_whole():
    block = Doubling()
    handle = graph_exit.register(block)

    def step(x: torch.Tensor) -> torch.Tensor:
        ids, w = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
        return graph_exit.moe_layer(x + 1, ids, w, torch.ones(1, 2), handle) * 3

    compiled = torch.compile(step, fullgraph=True, backend="eager")  # the trace, not Inductor's code: fast
    assert torch.equal(compiled(torch.zeros(1, 4)), step(torch.zeros(1, 4)))
    assert len(block.routes) == 2


def test_handles_count_up_and_are_held_weakly():
    first, second = Doubling(), Doubling()
    a, b = graph_exit.register(first), graph_exit.register(second)
    assert b == a + 1
    del first
    gc.collect()
    with pytest.raises(KeyError):
        graph_exit.moe_layer(torch.ones(1, 2), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1),
                             torch.ones(1, 1), a)
