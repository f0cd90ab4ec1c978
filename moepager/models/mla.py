"""Multi-head latent attention (DeepSeek-V2 §2.1), shared by DeepSeek-V2 and DeepSeek-V3.

The cache holds, per position, only the normalised KV latent c (kv_lora_rank wide) and the shared rotary key
k_pe (qk_rope_head_dim wide), in one tensor [B, S, 1, r + dr]. Attention runs in the "absorbed" form: the
no-RoPE query is multiplied into W_uk (q_abs = q_nope W_uk, per head) so scores are q_abs.c + q_pe.k_pe, and
values are the latents themselves, projected through W_uv after the softmax. That is multi-query attention
over the latent cache: one SDPA call, nothing expanded to per-head keys.
"""

from __future__ import annotations

import torch
from torch import nn

from moepager.models.attention import (
    ForwardBatch,
    RMSNorm,
    apply_rope,
    apply_rope_interleaved,
    attention,
    cache_update,
    yarn_softmax_scale,
)
from moepager.models.backend import Backend
from moepager.models.config import ModelConfig


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, interleaved_rope: bool, backend: Backend | None = None):
        super().__init__()
        raw = cfg.raw
        d, h = cfg.hidden_size, cfg.num_heads
        self.num_heads = h
        self.q_lora_rank = raw.get("q_lora_rank")
        self.kv_lora_rank = int(raw["kv_lora_rank"])
        self.nope_dim, self.rope_dim = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
        self.v_dim = int(raw["v_head_dim"])
        qk_dim = self.nope_dim + self.rope_dim
        bias = bool(raw.get("attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, backend=backend)
            self.q_b_proj = nn.Linear(self.q_lora_rank, h * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, backend=backend)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=bias)
        self.scale = qk_dim ** -0.5 * yarn_softmax_scale(cfg.rope)
        self.rope_fn = apply_rope_interleaved if interleaved_rope else apply_rope

    def make_cache(self, rows: int, max_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(rows, max_len, 1, self.kv_lora_rank + self.rope_dim, dtype=dtype, device=device)

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                cache: torch.Tensor) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        h, r = self.num_heads, self.kv_lora_rank
        q = self.q_proj(x_BTD) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q_nope, q_pe = q.view(b, t, h, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x_BTD).split([r, self.rope_dim], dim=-1)
        latent_BT1R = self.kv_a_layernorm(latent)[:, :, None]
        q_pe = self.rope_fn(q_pe, *rope)
        k_pe = self.rope_fn(k_pe[:, :, None], *rope)
        kv_B1SC = cache_update(cache, torch.cat((latent_BT1R, k_pe), dim=-1), batch)
        w_HCR = self.kv_b_proj.weight.view(h, self.nope_dim + self.v_dim, r)
        q_abs_BHTR = torch.einsum("bthn,hnr->bhtr", q_nope, w_HCR[:, : self.nope_dim])
        out_BHTR = attention(torch.cat((q_abs_BHTR, q_pe.transpose(1, 2)), dim=-1), kv_B1SC, kv_B1SC[..., :r],
                             batch.mask_B1TS, self.scale)
        out_BHTV = torch.einsum("bhtr,hvr->bhtv", out_BHTR, w_HCR[:, self.nope_dim:])
        return self.o_proj(out_BHTV.transpose(1, 2).reshape(b, t, h * self.v_dim))
