"""types.py's host memory helpers: huge-page tensors and moving weights onto them."""

from __future__ import annotations

import sys

import pytest
import torch

from moepager.loading.build import weights_on_huge_pages
from moepager.types import HUGE_PAGE, host_empty, rehome_on_huge_pages


@pytest.mark.parametrize("size, dtype", [((3, HUGE_PAGE // 2 + 7), torch.bfloat16),
                                         ((HUGE_PAGE * 2 + 64,), torch.uint8), ((5, 7), torch.float32)])
def test_host_empty_is_a_plain_tensor_of_the_shape_asked_for(size, dtype):
    t = host_empty(*size, dtype=dtype)
    assert t.shape == size and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    t.fill_(1)
    assert bool((t == 1).all())
    if t.nbytes >= HUGE_PAGE and sys.platform == "linux":
        assert t.data_ptr() % HUGE_PAGE == 0  # starts on a huge page boundary (what madvise was asked for)


def test_rehoming_copies_large_tensors_and_keeps_ties():
    big = torch.randn(HUGE_PAGE // 4 + 1)  # fp32: over 2 MiB
    small = torch.randn(16)
    out = list(rehome_on_huge_pages([big, small, big.view(-1)]))
    assert torch.equal(out[0], big) and out[0].data_ptr() != big.data_ptr()
    assert out[1] is small
    assert out[2] is out[0]  # the same view of the same memory: one copy


def test_a_models_large_weights_move_and_a_tied_head_stays_tied():
    emb = torch.nn.Embedding(1 << 12, 256)  # 4 MiB
    model = torch.nn.ModuleDict({"emb": emb, "head": torch.nn.Linear(256, 1 << 12, bias=False), "tiny":
                                 torch.nn.Linear(4, 4)})
    model["head"].weight = emb.weight
    before = emb.weight.detach().clone()
    weights_on_huge_pages(model)
    assert model["head"].weight is emb.weight and torch.equal(emb.weight, before)
    if sys.platform == "linux":
        assert emb.weight.data_ptr() % HUGE_PAGE == 0
