"""moepager's CPU kernels for the rest of an eager decode step (accel/csrc/step.h, bound by step.cpp), as a bf16 CPU
model's backend (models/backend.py: the one object the model is given when it is built): RMSNorm, the softmax top-k
router and a decode pass's attention one call each, where a layer's parts allow it the whole decoder layer in one call,
and where every layer has that call the whole decode pass (embedding to logits) in one.

Where the time went (the built-in model, bf16, eager, profiled): a torch RMSNorm is seven ops (19 norms a token), a
router six, an attention some twenty (views, RoPE, the cache write, SDPA), and each module call and attribute lookup of
nn.Module costs a microsecond or two, so a token took more than twice llama.cpp's time. With the kernels a layer is one
Python call (`DecodeLayerStep`), its parts run in C++ one after another.

Numerics: the kernels follow the torch path's roundings; a result may differ from torch's in its last bf16 bits (the
order of fp32 sums), and a router's tied experts may come in another order (torch's top-k leaves it unspecified). The
fused layer runs the same kernels in the same order as the layer's modules with the kernels, so the two agree bit for
bit; every row's result is the same whatever the batch. `--no-packed-dense` keeps torch's ops (and its GEMV).
"""

from __future__ import annotations

import torch
import torch.nn.modules.module as nn_hooks

from moepager.accel import cpu_kernels
from moepager.accel.ops import Kernels
from moepager.accel.packed import FUSED_DENSE_MAX_TOKENS, FusedLinear
from moepager.experts.executor import ResidentExecutor
from moepager.models.attention import NO_WEIGHT, Attention, ForwardBatch, RMSNorm
from moepager.models.backend import Backend
from moepager.models.layers import CausalLM, DecoderLayer
from moepager.models.moe import NATIVE_MAX_TOKENS, MoEBlock, SoftmaxTopKRouter
from moepager.models.routing import NULL_OBSERVER, OWN_ROUTER


def step_backend(dtype: torch.dtype, device: torch.device) -> Backend:
    """The backend of a model on `device` whose weights and activations are `dtype`: moepager's kernels for bf16 on
    the CPU where they run here (`KernelBackend`), else torch's ops alone."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not cpu_kernels.available():
        return Backend()
    return KernelBackend(cpu_kernels.extension())


class KernelBackend(Backend):
    """moepager's CPU kernels for a bf16 model on the CPU: every RMSNorm, softmax top-k router (up to
    NATIVE_MAX_TOKENS tokens) and attention layer's decode pass; once the weights are in, a `DecodeLayerStep` for each
    decoder layer whose parts all have them and a `DecodeModelStep` where every layer has one (`fuse`)."""

    name = "moepager's CPU kernels"

    def __init__(self, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        self.rms_norm = kernels.rms_norm
        self.router_topk = kernels.router_topk
        self.attention = kernels

    def fuse(self, model: torch.nn.Module) -> str:
        assert isinstance(model, CausalLM) and model.backend is self
        self.layer_steps.clear()
        self.model_step = None
        counts = {"norms": 0, "routers": 0, "decode attentions": 0, "whole decoder layers": 0, "whole decode step": 0}
        for m in model.modules():
            kind = "norms" if isinstance(m, RMSNorm) else "routers" if isinstance(m, SoftmaxTopKRouter) \
                else "decode attentions" if isinstance(m, Attention) else None
            if kind is not None and m.backend is self:
                counts[kind] += 1
        for layer in model.model.layers:
            if DecodeLayerStep.fits(layer):
                self.layer_steps[layer] = DecodeLayerStep(self.kernels, layer)
                counts["whole decoder layers"] += 1
        if DecodeModelStep.fits(model):
            self.model_step = DecodeModelStep(self.kernels, model)
            counts["whole decode step"] = 1
        parts = [f"{n} {what}" for what, n in counts.items() if n]
        return ", ".join(parts) + f" on {self.name}" if parts else ""


class DecodeLayerStep:
    """A decoder layer's decode pass in one call (csrc/step.cpp `DecodeLayer`): norm, q/k/v, attention over the paged
    cache, o, residual, norm, router, resident experts, residual. It declines (returns None, and the layer runs its
    modules) where the call would not be the modules' own arithmetic: more rows than the kernels take, an observer or
    a replayed routing on the block, another executor, or forward hooks on the attention or the MLP."""

    @staticmethod
    def fits(layer: DecoderLayer) -> bool:
        """Whether every part of `layer` has a step kernel: an Attention with a plain or per-head q/k norm and no clip
        on moepager's GEMV, a MoE block with no shared experts whose softmax top-k router and resident experts run on
        the fused kernels, both norms on the kernel with one eps."""
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        return (isinstance(attn, Attention) and attn.backend.attention is not None and attn.qk_norm in (None, "head")
                and attn.clip_qkv is None and isinstance(attn.qkv, FusedLinear) and isinstance(attn.o_proj, FusedLinear)
                and isinstance(mlp, MoEBlock) and not mlp.has_shared and isinstance(mlp.gate, SoftmaxTopKRouter)
                and mlp.gate.backend.router_topk is not None and isinstance(mlp.executor, ResidentExecutor)
                and mlp.executor.kernels.fused is not None and all(n.backend.rms_norm is not None for n in norms)
                and norms[0].eps == norms[1].eps)

    def __init__(self, module: Kernels, layer: DecoderLayer):
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn, Attention) and isinstance(mlp, MoEBlock) and self.fits(layer)
        executor = mlp.executor
        assert isinstance(executor, ResidentExecutor) and executor.kernels.fused is not None
        self.attn, self.mlp, self.executor = attn, mlp, executor
        self.max_rows = min(executor.kernels.fused.max_tokens, FUSED_DENSE_MAX_TOKENS, NATIVE_MAX_TOKENS)
        qkv, o, gate = attn.qkv, attn.o_proj, mlp.gate
        assert isinstance(qkv, FusedLinear) and isinstance(o, FusedLinear)
        qk_w, qk_eps = attn.kernel_qk_norm()
        self.native = module.DecodeLayer(
            norm1=layer.input_layernorm.weight, norm2=layer.post_attention_layernorm.weight,
            eps=layer.input_layernorm.eps, qkv_w=qkv.weight, qkv_b=NO_WEIGHT if qkv.bias is None else qkv.bias,
            qk_w=qk_w, qk_eps=qk_eps, heads=attn.num_heads, window=attn.window or 0, scale=attn.scale, o_w=o.weight,
            o_b=NO_WEIGHT if o.bias is None else o.bias, router_w=gate.weight, k=gate.top_k, normalize=gate.normalize,
            bf16_weights=not gate.fp32_weights, base=executor.base[mlp.layer], num_experts=executor.num_experts,
            **executor.kernels.fused.format)
        """The bound layer (torch.classes.<tier>.DecodeLayer)."""
        self.call = self.native.run

    def __call__(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                 cache: torch.Tensor) -> torch.Tensor | None:
        b, attn, mlp = x_BTD.shape[0], self.attn, self.mlp
        if b > self.max_rows or mlp.observer is not NULL_OBSERVER or mlp.routing is not OWN_ROUTER \
                or mlp.executor is not self.executor or attn.backend.attention is None or attn._forward_hooks \
                or mlp._forward_hooks:
            return None
        cos, sin = rope
        out = self.call(x_BTD.reshape(b, -1), cos.view(b, -1), sin.view(b, -1), cache, batch.block_table_BN,
                        batch.positions_BT.view(b), self.executor.kernels.arena)
        return out.view_as(x_BTD)


class DecodeModelStep:
    """A decode pass of the whole model in one call (csrc/step.cpp `DecodeModel`): the tokens' embedding rows, their
    positions' rotary rows, every decoder layer's `DecodeLayer`, the final norm and the LM head; logits [B, V]. The
    Python between the layers, the norm and the head (module calls, views, the per-layer checks) was a tenth of a
    small model's token or more. It declines (None: the modules compute, each layer by its own `DecodeLayerStep` where
    that applies) wherever a layer would: more rows than the kernels take, an observer or replayed routing, another
    executor, forward hooks on any module the pass would skip (the layers' and their parts', the embedding's, the
    norm's, the head's), padding."""

    @staticmethod
    def fits(model: CausalLM) -> bool:
        """Every decoder layer has a `DecodeLayerStep`, all on one executor; the embedding bf16, the final norm on the
        kernel, the head moepager's GEMV without a bias (a tied head too: `pack_dense` gave it its own module)."""
        layers = list(model.model.layers)
        steps = [model.backend.layer_steps.get(layer) for layer in layers]
        head, norm = model.lm_head, model.model.norm
        return (bool(layers) and all(isinstance(s, DecodeLayerStep) for s in steps)
                and len({id(s.executor) for s in steps}) == 1  # type: ignore[union-attr]
                and model.model.embed_tokens.weight.dtype == torch.bfloat16 and norm.backend.rms_norm is not None
                and isinstance(head, FusedLinear) and head.bias is None and head.weight.dtype == torch.bfloat16)

    def __init__(self, module: Kernels, model: CausalLM):
        assert self.fits(model)
        stack = model.model
        self.layers: list[DecodeLayerStep] = [model.backend.layer_steps[layer]  # type: ignore[misc]
                                              for layer in stack.layers]
        self.max_rows = min(s.max_rows for s in self.layers)
        self.rope = stack.rotary_emb
        self.executor = self.layers[0].executor
        self.watched = (stack.embed_tokens, stack.rotary_emb, stack.norm, model.lm_head) + tuple(
            m for layer in stack.layers for m in (layer, layer.self_attn, layer.mlp))
        """The modules a pass of the modules would call (each layer's parts past these run inside its step), whose
        hooks this call would skip."""
        head = model.lm_head
        assert isinstance(head, FusedLinear)
        self.native = module.DecodeModel(embed=stack.embed_tokens.weight, layers=[s.native for s in self.layers],
                                         norm=stack.norm.weight, eps=stack.norm.eps, head=head.weight)
        self.call = self.native.run

    def usable(self) -> bool:
        """Whether every layer's step would run (as `DecodeLayerStep.__call__` checks) and no module has a hook."""
        for s in self.layers:
            if s.mlp.observer is not NULL_OBSERVER or s.mlp.routing is not OWN_ROUTER \
                    or s.mlp.executor is not s.executor or s.attn.backend.attention is None:
                return False
        for m in self.watched:
            if m._forward_hooks or m._forward_pre_hooks:
                return False
        return not (nn_hooks._global_forward_hooks or nn_hooks._global_forward_pre_hooks)

    def __call__(self, ids_BT: torch.Tensor, batch: ForwardBatch, cache: list[torch.Tensor]) -> torch.Tensor | None:
        """Logits [B, V] of one decode token a row, or None where it declines."""
        b = ids_BT.shape[0]
        if b > self.max_rows or batch.valid_N is not None or batch.block_table_BN is None or not self.usable():
            return None
        table = self.rope._tables.get(torch.bfloat16)
        if table is None or table[0].shape[0] < batch.kv_len:
            self.rope(batch.positions_BT, torch.bfloat16)  # grows the tables past every position
            table = self.rope._tables[torch.bfloat16]
        return self.call(ids_BT.view(b), batch.positions_BT.view(b), table[0], table[1], cache, batch.block_table_BN,
                         self.executor.kernels.arena)
