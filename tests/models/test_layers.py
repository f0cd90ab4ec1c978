"""Blocks shared by the architectures (models/attention.py, moe.py, layers.py) against their plain definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moepager.models.attention import attention


@pytest.mark.parametrize("heads, kv_heads", [(8, 4), (16, 1), (4, 4)])
@pytest.mark.parametrize("rows, queries", [(1, 1), (3, 1), (3, 5)])
def test_attention_equals_sdpa_over_expanded_kv_heads(heads, kv_heads, rows, queries):
    """One query per row folds the query heads of each KV head into the query length; the result is the same
    attention as every query head reading its own copy of its KV head (with a mask of different prefix lengths
    per row, and a value width unlike the key's, as MLA has)."""
    gen = torch.Generator().manual_seed(0)
    s, dk, dv = 11, 16, 12
    q = torch.randn(rows, heads, queries, dk, generator=gen)
    k, v = torch.randn(rows, kv_heads, s, dk, generator=gen), torch.randn(rows, kv_heads, s, dv, generator=gen)
    lengths = torch.tensor([s, 7, 9][:rows])
    last_BT = lengths[:, None] - queries + torch.arange(queries)  # the queries are each row's last positions
    mask = torch.arange(s)[None, None, None, :] <= last_BT[:, None, :, None]
    repeat = heads // kv_heads
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                         attn_mask=mask, scale=0.3)
    got = attention(q, k, v, mask, scale=0.3)
    assert got.shape == (rows, heads, queries, dv)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if rows == 1:
        torch.testing.assert_close(attention(q, k, v, None), F.scaled_dot_product_attention(
            q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)), rtol=1e-5, atol=1e-5)
