"""The decoder stack identical across architectures: SwiGLU MLP, decoder layer, stack, and the causal LM around it
(attention in models/attention.py, the MoE block in models/moe.py).

Shape legend: B batch rows, T new tokens, S cached positions, H heads, Hkv KV heads, Dh head dim, D hidden,
V vocab. Sequences are left-aligned in the cache: position p of a row lives at cache index p, so a row's
position ids are also its cache indices and the causal mask is `s <= p`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from moepager.models.attention import CUDA_ATTENTION, ForwardBatch, RMSNorm, RotaryEmbedding
from moepager.models.backend import Backend
from moepager.models.config import ModelConfig
from moepager.models.moe import MoEBlock
from moepager.models.routing import NULL_OBSERVER, OWN_ROUTER, RoutingObserver, RoutingSource


class DenseMLP(nn.Module):
    """SwiGLU MLP with transformers' names (gate_proj, up_proj, down_proj)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)) computed on real (non-padding) tokens only."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module, mlp: nn.Module, backend: Backend | None = None):
        super().__init__()
        self.backend = backend = backend or Backend()
        """The model's backend: the layer's decode pass runs its fused call (`layer_steps`, bf16 CPU runs: accel/step.py
        `DecodeLayerStep`) outside a compiled graph where it has one; None from it: the modules compute."""
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.mlp = mlp

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                cache: torch.Tensor) -> torch.Tensor:
        step = self.backend.layer_steps.get(self)
        if step is not None and x_BTD.shape[1] == 1 and batch.block_table_BN is not None \
                and not torch.compiler.is_compiling():
            out = step(x_BTD, rope, batch, cache)
            if out is not None:
                return out
        x_BTD = x_BTD + self.self_attn(self.input_layernorm(x_BTD), rope, batch, cache)
        h_ND = self.post_attention_layernorm(x_BTD).reshape(-1, x_BTD.shape[-1])
        if batch.valid_N is None:
            return x_BTD + self.mlp(h_ND).view_as(x_BTD)
        out_ND = torch.zeros_like(h_ND)
        out_ND[batch.valid_N] = self.mlp(h_ND[batch.valid_N])
        return x_BTD + out_ND.view_as(x_BTD)


class DecoderStack(nn.Module):
    """Embeddings, decoder layers and the final norm (the `model.` prefix of transformers' names)."""

    def __init__(self, cfg: ModelConfig, layers: Sequence[nn.Module], rope: RotaryEmbedding,
                 backend: Backend | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.backend = backend = backend or Backend()
        """The backend the model's blocks were built with (models/backend.py)."""
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.rotary_emb = rope


NATIVE_GEMV_MAX_HIDDEN = 16384
"""A CPU forward of one token computes with torch's own GEMV kernels instead of oneDNN up to this hidden size (every
supported model): per matrix the two trade wins, and the big ones (an LM head) decide for torch's."""


class CausalLM(nn.Module):
    """A decoder stack plus the LM head; `forward` returns logits for the requested positions."""

    def __init__(self, cfg: ModelConfig, stack: DecoderStack, disk_renames: Mapping[str, str] | None = None):
        super().__init__()
        self.backend = stack.backend
        """The backend the model's blocks were built with (the stack's): a decode pass runs its whole-model
        call (`model_step`, bf16 CPU runs: accel/step.py `DecodeModelStep`) outside a compiled step where it has
        one, the logits at `logits_at_B`; None from it: the modules compute."""
        self.config = cfg
        self.model = stack
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.disk_renames = dict(disk_renames or {})
        self.compiled_decode: Callable[..., torch.Tensor] | None = None
        """`hidden_states` compiled for decode passes (`--compile`, accel/compiled.py; the LM head after it); None:
        eager."""
        self.compiled_rows = False
        """The compiled step also runs decode passes of several rows (one graph for every row count >= 2)."""
        self.traceable = True
        """Every MoE block routes with its own router, and reports to no observer unless its experts leave the graph
        for the host (what the compiled step traces; `refresh_traceable`)."""

    def disk_name(self, module_name: str) -> str:
        """The checkpoint tensor name of a module parameter (some Hub formats use other names)."""
        for ours, theirs in self.disk_renames.items():
            module_name = module_name.replace(ours, theirs)
        return module_name

    def moe_blocks(self) -> list[MoEBlock]:
        """The MoE blocks in layer order."""
        return sorted((m for m in self.modules() if isinstance(m, MoEBlock)), key=lambda m: m.layer)

    def observe_routing(self, observer: RoutingObserver) -> None:
        """Every MoE block reports its routing decisions to `observer` (NULL_OBSERVER stops it)."""
        for block in self.moe_blocks():
            block.observer = observer
        self.refresh_traceable()

    def first_non_finite(self, ids_BT: torch.Tensor, batch: ForwardBatch,
                         cache: Sequence[torch.Tensor]) -> str:
        """Re-run a forward pass (same positions, so the cache is rewritten with the same values) and name the
        first module whose output holds NaN or infinity."""
        found: list[str] = []

        def watch(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
                if not found and isinstance(out, torch.Tensor) and not bool(torch.isfinite(out).all()):
                    found.append(name)
            return hook
        watched = [(self.model.embed_tokens, "the token embedding")]
        for i, layer in enumerate(self.model.layers):
            watched += [(layer.self_attn, f"decoder layer {i} (attention)"), (layer.mlp, f"decoder layer {i} (MLP)")]
        watched.append((self.model.norm, "the final norm"))
        handles = [module.register_forward_hook(watch(name)) for module, name in watched]
        try:
            with torch.inference_mode():
                self(ids_BT, batch, cache)
        finally:
            for handle in handles:
                handle.remove()
        return found[0] if found else "the LM head"

    def route_with(self, source: RoutingSource) -> None:
        """Every MoE block takes its routing from `source` (OWN_ROUTER restores the model's routers)."""
        for block in self.moe_blocks():
            block.routing = source
        self.refresh_traceable()

    def refresh_traceable(self) -> None:
        """Recompute `traceable` after routing sources, observers or graph exits changed."""
        self.traceable = all(b.routing is OWN_ROUTER and (b.observer is NULL_OBSERVER or b.graph_exit is not None)
                             for b in self.moe_blocks())

    def make_cache(self, rows: int, max_len: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        return [layer.self_attn.make_cache(rows, max_len, dtype, device) for layer in self.model.layers]

    def cache_bytes(self, num_tokens: int, block_size: int, dtype: torch.dtype) -> int:
        """What a block KV cache of `num_tokens` positions takes (its blocks, one spare: runtime/kv_pool.py), from
        the layers' cache shapes made on the meta device."""
        block = sum(t.nbytes for t in self.make_cache(1, block_size, dtype, torch.device("meta")))
        return (math.ceil(num_tokens / block_size) + 1) * block

    def forward(self, ids_BT: torch.Tensor, batch: ForwardBatch, cache: Sequence[torch.Tensor],
                logits_at_B: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V], or [B, V] at token index `logits_at_B[b]` of each row when given."""
        if ids_BT.is_cuda:
            with sdpa_kernel(CUDA_ATTENTION):
                return self._forward(ids_BT, batch, cache, logits_at_B)
        step = self.backend.model_step
        if step is not None and logits_at_B is not None and ids_BT.shape[1] == 1 and self.compiled_decode is None:
            out = step(ids_BT, batch, cache)
            if out is not None:
                return out
        compiled = (self.compiled_decode is not None and self.traceable and ids_BT.shape[1] == 1 and batch.kv_len > 1
                    and (ids_BT.shape[0] == 1 or self.compiled_rows))  # kv_len 1 (one-token prompts) would compile
        if (compiled or ids_BT.numel() == 1) and self.config.hidden_size <= NATIVE_GEMV_MAX_HIDDEN:
            mkldnn = torch._C._get_mkldnn_enabled()
            torch._C._set_mkldnn_enabled(False)
            try:
                return self._forward(ids_BT, batch, cache, logits_at_B, self.compiled_decode if compiled else None)
            finally:
                torch._C._set_mkldnn_enabled(mkldnn)
        return self._forward(ids_BT, batch, cache, logits_at_B)

    def _forward(self, ids_BT: torch.Tensor, batch: ForwardBatch, cache: Sequence[torch.Tensor],
                 logits_at_B: torch.Tensor | None, hidden: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """`hidden` (default `hidden_states`; the compiled step's graph), then the LM head."""
        x_BTD = (hidden or self.hidden_states)(ids_BT, batch, cache, logits_at_B)
        return F.linear(x_BTD, self.model.embed_tokens.weight) if self.lm_head is None else self.lm_head(x_BTD)

    def hidden_states(self, ids_BT: torch.Tensor, batch: ForwardBatch, cache: Sequence[torch.Tensor],
                logits_at_B: torch.Tensor | None) -> torch.Tensor:
        """The final norm's output at the positions whose logits are asked for (every position without them)."""
        x_BTD = self.model.embed_tokens(ids_BT)
        rope = self.model.rotary_emb(batch.positions_BT, x_BTD.dtype)
        for layer, layer_cache in zip(self.model.layers, cache):
            x_BTD = layer(x_BTD, rope, batch, layer_cache)
        if logits_at_B is not None:  # (one token a row: its only position, as a view)
            x_BTD = x_BTD[:, 0] if x_BTD.shape[1] == 1 else \
                x_BTD[torch.arange(x_BTD.shape[0], device=x_BTD.device), logits_at_B]
        return self.model.norm(x_BTD)


