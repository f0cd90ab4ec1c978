"""Expert reading in both layouts and the fixed-order expert sum."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moepager.checkpoints.expert_reader import ExpertLayout, ExpertReader
from moepager.checkpoints.safetensors import Checkpoint
from moepager.experts.executor import ResidentExecutor
from moepager.experts.reference import combine_experts, expert_forward
from moepager.experts.weights import ExpertShape, ExpertWeights
from moepager.loading.build import read_resident
from moepager.models.naming import PER_EXPERT_MLP
from moepager.types import ExpertKey, RoutingDecision


def test_both_layouts_read_identical_expert_buffers(hf_checkpoint):
    shape = ExpertShape(32, 16, torch.float32)
    readers = {}
    for fused in (False, True):
        ckpt = Checkpoint(hf_checkpoint("qwen3_moe", fused)[1])
        readers[fused] = ExpertReader(ckpt, PER_EXPERT_MLP, shape, first_moe_layer=0)
    assert readers[False].layout is ExpertLayout.PER_EXPERT and readers[True].layout is ExpertLayout.FUSED
    for e in range(6):
        a, b = ExpertWeights.empty(shape), ExpertWeights.empty(shape)
        readers[False].read(ExpertKey(1, e), a.buffer)
        readers[True].read(ExpertKey(1, e), b.buffer)
        assert torch.equal(a.buffer, b.buffer)
    hf = hf_checkpoint("qwen3_moe")[0]
    ref = hf.model.layers[1].mlp.experts
    assert torch.equal(a.gate_up_2FD, ref.gate_up_proj[5]) and torch.equal(a.down_DF, ref.down_proj[5])


def test_reader_converts_dtype(hf_checkpoint):
    shape = ExpertShape(32, 16, torch.bfloat16)
    reader = ExpertReader(Checkpoint(hf_checkpoint("qwen3_moe")[1]), PER_EXPERT_MLP, shape, 0)
    w = ExpertWeights.empty(shape)
    reader.read(ExpertKey(0, 0), w.buffer)
    ref = hf_checkpoint("qwen3_moe")[0].model.layers[0].mlp.experts.gate_up_proj[0]
    assert torch.equal(w.gate_up_2FD, ref.to(torch.bfloat16))


class _Fixed:
    """A source over explicit weights that records what was requested and whether the stream finished."""

    def __init__(self, weights):
        self.weights, self.requested, self.finished = weights, [], 0

    def stream(self, layer, experts):
        self.requested.append(list(experts))
        for e in experts:
            yield self.weights[e]
        self.finished += 1


def test_combine_matches_per_token_reference_and_visits_experts_in_order():
    gen = torch.Generator().manual_seed(0)
    shape = ExpertShape(8, 4, torch.float32)
    weights = [ExpertWeights(torch.randn(shape.numel, generator=gen), shape) for _ in range(5)]
    x = torch.randn(6, 8, generator=gen)
    ids = torch.tensor([[4, 0], [1, 4], [2, 3], [0, 1], [3, 2], [4, 1]])
    w = torch.rand(6, 2, generator=gen)
    source = _Fixed(weights)
    out = combine_experts(x, RoutingDecision(ids, w, torch.zeros(len(ids), 5)), source, layer=0, num_experts=5)
    ref = torch.stack([sum(w[t, k] * expert_forward(x[t:t + 1], weights[int(ids[t, k])], F.silu)[0]
                           for k in range(2)) for t in range(6)])
    torch.testing.assert_close(out, ref)
    assert source.requested == [[0, 1, 2, 3, 4]] and source.finished == 1


def test_resident_arena_holds_every_expert(hf_checkpoint):
    shape = ExpertShape(32, 16, torch.float32)
    reader = ExpertReader(Checkpoint(hf_checkpoint("olmoe")[1]), PER_EXPERT_MLP, shape, 0)
    seen = []
    arena = read_resident(reader, [0, 1, 2], 8, torch.device("cpu"), progress=seen.append)
    assert len(seen) == 24 and sum(seen) == 24 * shape.nbytes
    executor = ResidentExecutor(arena, shape, [0, 1, 2], 8)
    got = list(executor.stream(2, [7, 3]))
    ref = hf_checkpoint("olmoe")[0].model.layers[2].mlp.experts.down_proj
    assert torch.equal(got[0].down_DF, ref[7]) and torch.equal(got[1].down_DF, ref[3])
