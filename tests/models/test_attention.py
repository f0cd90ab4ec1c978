"""RotaryEmbedding's CPU tables (models/attention.py): rows looked up from tables computed once equal the formula's
values bit for bit, whatever the positions' order and the dtype; the tables grow past the longest sequence seen."""

from __future__ import annotations

import pytest
import torch

from moepager.models.attention import RotaryEmbedding
from moepager.models.config import RopeConfig

ROPES = [RopeConfig(10000.0, 40), RopeConfig(1e6, 128),
         RopeConfig(10000.0, 64, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}),
         RopeConfig(10000.0, 32, {"rope_type": "linear", "factor": 2.0})]


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_table_rows_equal_the_formula_bit_for_bit(rope, dtype):
    r = RotaryEmbedding(rope, 2048)
    for positions in ([[0, 5, 1023], [1024, 3000, 7]], [[4]], [[5000, 2]]):
        pos = torch.tensor(positions)
        got, want = r(pos, dtype), r.compute(pos, dtype)
        assert all(g.shape == w.shape == (*pos.shape, 1, rope.dim) and torch.equal(g, w) for g, w in zip(got, want))
    assert r._tables[dtype][0].shape[0] == 8192  # grown to the power of two past position 5000


def test_no_positions_give_empty_tables():
    r = RotaryEmbedding(RopeConfig(10000.0, 16), 64)
    cos, sin = r(torch.empty(1, 0, dtype=torch.long), torch.bfloat16)
    assert cos.shape == sin.shape == (1, 0, 1, 16)


@pytest.mark.parametrize("heads, kv_heads", [(16, 1), (8, 2)])
def test_a_long_chunk_attends_in_row_blocks_with_the_same_result(monkeypatch, heads, kv_heads):
    """Past SCORES_MAX scores a chunk's queries go through SDPA in row blocks (its math path holds every score):
    the same output bit for bit, and no call holds more than the limit's scores. Where oneDNN runs on AMX tiles, torch's
    CPU flash attention packs keys and values for them or not by how many query rows a call has, so a row's bits depend
    on its block there: within one bf16 rounding of the whole (seen: 2 of 153,600 outputs, on an Intel Xeon with AMX;
    with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 the same host gives the same bits)."""
    import torch.nn.functional as F

    import moepager.models.attention as attention_module

    torch.manual_seed(0)
    t, s, d = 300, 900, 32
    q = torch.randn(1, heads, t, d, dtype=torch.bfloat16)
    k, v = (torch.randn(1, kv_heads, s, d, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(1, 1, t, s, dtype=torch.bool).tril(s - t)
    whole = attention_module.attention(q, k, v, mask)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counted(q_, *args, **kwargs):
        calls.append(q_.shape[2])
        return sdpa(q_, *args, **kwargs)
    monkeypatch.setattr(attention_module, "SCORES_MAX", heads * s * 64)
    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", counted)
    blocked = attention_module.attention(q, k, v, mask)
    if torch.cpu._is_amx_tile_supported():
        torch.testing.assert_close(blocked, whole, rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(whole, blocked)
    assert calls == [64] * 4 + [44]
