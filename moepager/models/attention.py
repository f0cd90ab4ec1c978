"""Attention and what it needs, identical across architectures: RMSNorm, RoPE (with YaRN), the batch of a forward
pass and its paged KV cache, GQA attention.

Shape legend: B batch rows, T new tokens, S cached positions, H heads, Hkv KV heads, Dh head dim, D hidden.
Sequences are left-aligned in the cache: position p of a row lives at cache index p, so a row's position ids are also
its cache indices and the causal mask is `s <= p`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from moepager.models.backend import Backend
from moepager.models.config import ModelConfig, RopeConfig

QKNorm = Literal["head", "full"] | None
"""RMSNorm of q and k: per head (Qwen3), over the whole projection (OLMoE), or none."""


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back before the weight (as transformers does)."""

    def __init__(self, dim: int, eps: float = 1e-6, backend: Backend | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend = backend or Backend()
        """The model's backend: its `rms_norm` (bf16 CPU runs: one call where torch's eager norm is seven ops)
        computes bf16 inputs outside a compiled graph."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`weight` in place of the module's (one that broadcasts: Attention normalises q and k heads at once).
        torch's rms_norm is x32 * rsqrt(mean(x32^2) + eps): on the CPU the same ops as written out (bit-equal), on
        CUDA one fused kernel for five (a decode step runs three norms a layer, and one after the last)."""
        kernel = self.backend.rms_norm
        if kernel is not None and x.dtype is torch.bfloat16 and not torch.compiler.is_compiling():
            return kernel(x, self.weight if weight is None else weight, self.eps)
        x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (self.weight if weight is None else weight) * x32.to(x.dtype)


def _yarn_inv_freq(rope: RopeConfig, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN frequencies and attention factor (Peng et al. 2023, "YaRN", eqs. 18-21 and mscale)."""
    s = rope.scaling or {}
    dim, base = rope.dim, rope.theta
    factor = float(s.get("factor") or max_pos / s["original_max_position_embeddings"])
    orig = s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def yarn_softmax_scale(rope: RopeConfig) -> float:
    """DeepSeek's extra softmax scale under YaRN: mscale(factor, mscale_all_dim)^2 (1 otherwise)."""
    s = rope.scaling or {}
    m_all, factor = s.get("mscale_all_dim"), s.get("factor", 1.0)
    if s.get("rope_type") != "yarn" or not m_all or factor <= 1:
        return 1.0
    m = 0.1 * m_all * math.log(factor) + 1.0
    return m * m


class RotaryEmbedding(nn.Module):
    """cos/sin tables for position ids; default, linear and YaRN frequency schedules."""

    def __init__(self, rope: RopeConfig, max_position_embeddings: int):
        super().__init__()
        kind = (rope.scaling or {}).get("rope_type", "default")
        scale = 1.0
        if kind == "yarn":
            inv_freq, scale = _yarn_inv_freq(rope, max_position_embeddings)
        else:
            channels = torch.arange(0, rope.dim, 2, dtype=torch.float32, device="cpu")
            inv_freq = 1.0 / (rope.theta ** (channels / rope.dim))
            if kind == "linear":
                inv_freq = inv_freq / float(rope.scaling["factor"])  # type: ignore[index]
        self.inv_freq = inv_freq
        """A plain attribute, not a buffer: it is derived from the config, never loaded or cast."""
        self.attention_scaling = scale
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        """On the CPU: cos and signed sin [P, Dh] of positions 0..P-1 by dtype, P a power of two past every position
        seen (grown as longer sequences come)."""

    def forward(self, positions_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [B, T, 1, Dh]: they broadcast over the heads of [B, T, H, Dh] queries and keys. The
        sin table carries rotate_half's sign ([-sin | sin]: both halves of each table hold the same angles). On the
        CPU they are rows of tables computed once (two lookups where the formula is some ten ops a pass: ~6% of the
        built-in model's eager decode step at one thread, ad-hoc probe, 2026-11-28); on a GPU, where reading the
        largest position would synchronize, and in a compiled graph, they are computed each pass."""
        if positions_BT.device.type != "cpu" or positions_BT.numel() == 0 or torch.compiler.is_compiling():
            return self.compute(positions_BT, dtype)
        end = int(positions_BT.max()) + 1
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < end:
            size = max(1024, 1 << (end - 1).bit_length())
            cos, sin = self.compute(torch.arange(size).view(1, size), dtype)
            table = self._tables[dtype] = (cos.view(size, -1), sin.view(size, -1))
        cos, sin = table
        flat, shape = positions_BT.reshape(-1), (*positions_BT.shape, 1, cos.shape[-1])
        return cos.index_select(0, flat).view(shape), sin.index_select(0, flat).view(shape)

    def compute(self, positions_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s tables by the formula, for the positions given."""
        if self.inv_freq.device != positions_BT.device:
            self.inv_freq = self.inv_freq.to(positions_BT.device)
        freqs = positions_BT[..., None, None].float() * self.inv_freq
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x_BTHD: torch.Tensor, cos_BT1D: torch.Tensor, signed_sin_BT1D: torch.Tensor) -> torch.Tensor:
    """Rotation of channel pairs (i, i + Dh/2): x * cos + rotate_half(x) * sin, where rotate_half(x) * sin =
    [-x2 | x1] * sin = [x2 | x1] * [-sin | sin] (the same products bit for bit; a roll is one op against four)."""
    return x_BTHD * cos_BT1D + x_BTHD.roll(x_BTHD.shape[-1] // 2, -1) * signed_sin_BT1D


def apply_rope_interleaved(x_BTHD: torch.Tensor, cos_BT1D: torch.Tensor, signed_sin_BT1D: torch.Tensor
                           ) -> torch.Tensor:
    """Rotation of adjacent pairs (2i, 2i+1), output as [rotated evens | rotated odds] (DeepSeek layout).

    The permutation is the same for queries and keys, so their dot products equal the interleaved form's.
    """
    half = cos_BT1D.shape[-1] // 2
    cos, sin = cos_BT1D[..., :half], signed_sin_BT1D[..., half:]
    x1, x2 = x_BTHD[..., 0::2], x_BTHD[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@dataclass
class ForwardBatch:
    """Per-forward metadata shared by every layer.

    The KV cache is either contiguous rows ([rows, S, Hc, C]: row b's position p at index p) or paged blocks
    ([num_blocks, block_size, Hc, C]: row b's position p in block `block_table_BN[b, p // block_size]` at offset
    p % block_size, written at the slots `slot_block_BT`/`slot_offset_BT` the engine assigns; padding tokens
    write to a scratch block no row reads unmasked). Positions are the outer dimension so that a row's blocks,
    gathered, are its [S, Hc, C] prefix as they lie: attention reads them as a transposed view, no copy."""

    positions_BT: torch.Tensor
    """Position of every new token."""
    mask_B1TS: torch.Tensor | None
    """True where query t of row b may attend to cache index s; None when every query attends to the whole
    prefix (one row decoding one token, no sliding window)."""
    kv_len: int
    """S: cache prefix every row's attention reads."""
    rows_B: torch.Tensor | None = None
    """Cache rows the B batch rows map to; None means rows 0..B-1 of the cache (contiguous caches only)."""
    valid_N: torch.Tensor | None = None
    """Flat indices (into B*T) of real tokens when rows are right-padded; None means all are real."""
    block_table_BN: torch.Tensor | None = None
    """Paged caches: the blocks holding each row's positions, in order (padded with the scratch block)."""
    slot_block_BT: torch.Tensor | None = None
    slot_offset_BT: torch.Tensor | None = None

    @classmethod
    def build(cls, positions_BT: torch.Tensor, rows_B: torch.Tensor | None = None,
              valid_BT: torch.Tensor | None = None, sliding_window: int | None = None,
              kv_len: int | None = None, paged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              valid_N: torch.Tensor | None = None, masked: bool = False) -> ForwardBatch:
        """`kv_len` (the largest position + 1) is read from the positions unless the caller knows it: on CUDA a host
        sync, as is finding the real tokens in `valid_BT` (callers that know them pass `valid_N`). `paged`: (block
        table, slot blocks, slot offsets). `masked`: a mask even for one row's one token (runtime/cuda_graphs.py)."""
        kv_len = int(positions_BT.max()) + 1 if kv_len is None else kv_len
        table, slot_block, slot_offset = paged if paged is not None else (None, None, None)
        if positions_BT.shape == (1, 1) and not masked and not (sliding_window and kv_len > sliding_window):
            return cls(positions_BT, None, kv_len, rows_B, None, table, slot_block, slot_offset)
        s = torch.arange(kv_len, device=positions_BT.device)
        pos = positions_BT[:, :, None]
        mask = s <= pos
        if sliding_window:
            mask &= pos - s < sliding_window
        if valid_N is None and valid_BT is not None and not bool(valid_BT.all()):
            valid_N = valid_BT.reshape(-1).nonzero().squeeze(1)
        return cls(positions_BT, mask[:, None], kv_len, rows_B, valid_N, table, slot_block, slot_offset)


def cache_update(cache: torch.Tensor, new_BTHC: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Store the new entries (keys and values side by side on the head axis, or MLA's one latent) at their
    positions in the cache (per row, so rows may be at different lengths), then read the prefix as [B, Hc, S, C]
    (a transposed view of the [B, S, Hc, C] rows or gathered blocks)."""
    if new_BTHC.dtype != cache.dtype:
        new_BTHC = new_BTHC.to(cache.dtype)
    if batch.block_table_BN is not None:
        assert batch.slot_block_BT is not None
        cache[batch.slot_block_BT, batch.slot_offset_BT] = new_BTHC
        b, n = batch.block_table_BN.shape
        _, block, h, c = cache.shape
        blocks = cache.index_select(0, batch.block_table_BN.view(-1))  # faster than indexing on the CPU
        return blocks.view(b, n * block, h, c)[:, : batch.kv_len].transpose(1, 2)
    b, t = batch.positions_BT.shape
    rows = batch.rows_B if batch.rows_B is not None else torch.arange(b, device=cache.device)
    cache[rows[:, None].expand(b, t), batch.positions_BT] = new_BTHC
    prefix = cache[:b, : batch.kv_len] if batch.rows_B is None else cache[batch.rows_B, : batch.kv_len]
    return prefix.transpose(1, 2)


SCORES_MAX = 1 << 24
"""Most attention scores one SDPA call computes at once. With a mask SDPA takes its math path on the CPU, which holds
every score in fp32 with its softmax (about 10 bytes a score: 2.7 GB for a 2,048-token chunk of DeepSeek-V2's 16 heads
over 8,192 positions); a longer chunk's queries go through in row blocks within this (at most ~170 MB), each query
row's attention being its own: the same bits, except where oneDNN runs on AMX tiles, whose flash attention packs keys
and values or not by a call's query rows (within one bf16 rounding; tests/models/test_attention.py)."""


def attention(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, mask_B1TS: torch.Tensor | None,
              scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention of H query heads over Hkv key/value heads (H a multiple of Hkv).

    A decode step (one query per row) of grouped-query attention runs as plain attention of Hkv heads whose G = H/Hkv
    query heads are G queries: [B, Hkv, G, D] against [B, Hkv, S, D], the same scores with no key/value head
    expanded and G times fewer kernel rows: on the CPU several times faster than SDPA's `enable_gqa` at one query
    (`python -m benchmarks run attention`); equal bit for bit on the built-in model's heads, within bf16 rounding
    on DeepSeek-V2's absorbed MLA."""
    b, h, t, d = q_BHTD.shape
    hkv = k_BHSD.shape[1]
    if t == 1 and h != hkv:
        q_BKGD = q_BHTD.reshape(b, hkv, h // hkv, d)
        out = F.scaled_dot_product_attention(q_BKGD, k_BHSD, v_BHSD, attn_mask=mask_B1TS, scale=scale)
        return out.reshape(b, h, 1, out.shape[-1])
    rows = t if t == 1 else max(1, SCORES_MAX // (b * h * k_BHSD.shape[2]))  # (a decode step: nothing to split)
    if t <= rows:
        return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=mask_B1TS, scale=scale,
                                              enable_gqa=h != hkv)
    return torch.cat([F.scaled_dot_product_attention(q_BHTD[:, :, i: i + rows], k_BHSD, v_BHSD,
                                                     attn_mask=None if mask_B1TS is None else
                                                     mask_B1TS[:, :, i: i + rows], scale=scale, enable_gqa=h != hkv)
                      for i in range(0, t, rows)], dim=2)


NO_WEIGHT = torch.empty(0, dtype=torch.bfloat16)
"""No q/k norm, to the CPU decode attention kernel."""


class Attention(nn.Module):
    """Grouped-query attention with RoPE, optional q/k RMSNorm (per head or over the whole projection) and
    optional clipping of q/k/v (OLMoE's clip_qkv)."""

    def __init__(self, cfg: ModelConfig, *, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: QKNorm = None, clip_qkv: float | None = None, backend: Backend | None = None):
        super().__init__()
        self.backend = backend = backend or Backend()
        """The model's backend: its `attention` (bf16 CPU runs) computes a decode pass of one token a row over the
        paged cache in one call (q/k norm, RoPE, cache write, attention) outside a compiled graph."""
        d, h, hkv, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, dh
        self.q_proj = nn.Linear(d, h * dh, bias=qkv_bias)
        self.k_proj = nn.Linear(d, hkv * dh, bias=qkv_bias)
        self.v_proj = nn.Linear(d, hkv * dh, bias=qkv_bias)
        self.o_proj = nn.Linear(h * dh, d, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(dh, cfg.rms_norm_eps, backend), RMSNorm(dh, cfg.rms_norm_eps, backend)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(h * dh, cfg.rms_norm_eps, backend)
            self.k_norm = RMSNorm(hkv * dh, cfg.rms_norm_eps, backend)
        self.clip_qkv = clip_qkv
        self.window = cfg.sliding_window
        self.scale = 1.0 / math.sqrt(dh)
        """SDPA's default scale, as it computes it."""
        self._qk_weight: tuple[tuple[int, int, torch.device], torch.Tensor] | None = None
        self._qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.qkv: nn.Module | None = None
        """The fused q/k/v projection as a module of its own when it is not the three Linear weights (int8)."""

    def make_cache(self, rows: int, max_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Keys and values in one tensor [rows, max_len, 2 * Hkv, Dh] (keys on heads 0..Hkv-1): one write and
        one gather per step for both."""
        return torch.zeros(rows, max_len, 2 * self.num_kv_heads, self.head_dim, dtype=dtype, device=device)

    def fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q, k and v projections as one weight (and bias): made at the first call after the weights are in
        place, with the three parameters turned into views of it, so it costs no memory and stays current."""
        if self._qkv is not None and torch.compiler.is_compiling():  # made before compiling (accel/compiled.py)
            return self._qkv
        w = self.q_proj.weight
        if self._qkv is None or self._qkv[0].data_ptr() != w.data_ptr() or self._qkv[0].device != w.device:
            projs = (self.q_proj, self.k_proj, self.v_proj)
            fused_w = torch.cat([p.weight.data for p in projs])
            fused_b = torch.cat([p.bias.data for p in projs]) if self.q_proj.bias is not None else None
            start = 0
            for p in projs:
                n = p.weight.shape[0]
                p.weight.data = fused_w[start:start + n]
                if fused_b is not None:
                    p.bias.data = fused_b[start:start + n]
                start += n
            self._qkv = (fused_w, fused_b)
        return self._qkv

    def replace_qkv(self, qkv: nn.Module) -> None:
        """Compute q/k/v with `qkv` (made from `fused_qkv()`: an int8 or prepacked projection) and drop the three
        Linear modules, whose weights were views of the fused one."""
        self.qkv = qkv
        self.q_proj = self.k_proj = self.v_proj = self._qkv = None

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                cache: torch.Tensor) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        qkv = F.linear(x_BTD, *self.fused_qkv()) if self.qkv is None else self.qkv(x_BTD)
        if self.qk_norm == "full":
            kv_size = self.num_kv_heads * self.head_dim
            q, k, v = qkv.split((self.num_heads * self.head_dim, kv_size, kv_size), dim=-1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        kernels = self.backend.attention
        if kernels is not None and t == 1 and batch.block_table_BN is not None and not torch.compiler.is_compiling():
            cos, sin = rope
            out = kernels.decode_attention(qkv.view(b, -1), *self.kernel_qk_norm(), cos.view(b, -1), sin.view(b, -1),
                                           cache, batch.block_table_BN, batch.positions_BT.view(b), self.num_heads,
                                           self.window or 0, self.scale)
            return self.o_proj(out.view(b, 1, -1))
        # Queries and keys as one [B, T, H + Hkv, Dh] tensor: per-head norm and RoPE once for both
        h, hq, hkv = self.num_heads + self.num_kv_heads, self.num_heads, self.num_kv_heads
        heads_BTND = qkv.view(b, t, -1, self.head_dim)
        qk_BTND = heads_BTND[:, :, :h]
        if self.qk_norm == "head":
            qk_BTND = self.q_norm(qk_BTND, self.qk_norm_weight())
        qk_BTND = apply_rope(qk_BTND, *rope)
        kv_BNSD = cache_update(cache, torch.cat((qk_BTND[:, :, hq:], heads_BTND[:, :, h:]), dim=2), batch)
        out = attention(qk_BTND[:, :, :hq].transpose(1, 2), kv_BNSD[:, :hkv], kv_BNSD[:, hkv:], batch.mask_B1TS)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def kernel_qk_norm(self) -> tuple[torch.Tensor, float]:
        """The q/k norm as the CPU kernels take it: the per-head weight [H + Hkv, Dh] and eps, or an empty weight (no
        norm in the kernel: a whole-projection norm is applied before it)."""
        return (self.qk_norm_weight(), self.q_norm.eps) if self.qk_norm == "head" else (NO_WEIGHT, 0.0)

    def qk_norm_weight(self) -> torch.Tensor:
        """q_norm's weight for each query head, then k_norm's for each key head, as one [H + Hkv, Dh] tensor
        (remade when either weight is replaced or moves, as `fused_qkv` is; version counters are not read: weights
        loaded under inference mode have none)."""
        if self._qk_weight is not None and torch.compiler.is_compiling():  # made before compiling
            return self._qk_weight[1]
        q, k = self.q_norm.weight, self.k_norm.weight
        key = (q.data_ptr(), k.data_ptr(), q.device)
        if self._qk_weight is None or self._qk_weight[0] != key:
            w = torch.cat((q.detach().expand(self.num_heads, -1), k.detach().expand(self.num_kv_heads, -1)))
            self._qk_weight = (key, w)
        return self._qk_weight[1]


CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Attention backends on CUDA, chosen explicitly: not cuDNN's, which plans again for every new KV length (on the CPU,
at every call: a decode step at a fresh length is several times slower than at a warm one)."""
