"""The model's one backend (models/backend.py): every block of a model holds the object the model was built with,
its kernels compute where it has them, and its fused calls are tried first and may decline."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from moepager.accel import cpu_kernels, step
from moepager.loading.build import cast_model
from moepager.models.attention import Attention, ForwardBatch, RMSNorm
from moepager.models.backend import Backend
from moepager.models.moe import SoftmaxTopKRouter
from moepager.models.registry import architecture_for
from moepager.runtime.builder import load_model
from tests.conftest import ARCHS, VOCAB

BF16 = torch.bfloat16


class CountingBackend(Backend):
    """torch's own arithmetic written as a norm kernel and a router kernel, and fused calls that always decline; each
    counts its calls."""

    name = "counting"

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.rms_norm = self.norm
        self.router_topk = self.router

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self.calls["norm"] += 1
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    def router(self, x: torch.Tensor, weight: torch.Tensor, k: int, normalize: bool) -> list[torch.Tensor]:
        self.calls["router"] += 1
        probs = torch.softmax(F.linear(x, weight), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k, dim=-1)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return [ids, weights, probs]

    def declined(self, what: str) -> None:
        self.calls[what] += 1

    def fuse(self, model: torch.nn.Module) -> str:
        self.layer_steps = {layer: lambda *args: self.declined("layer step") for layer in model.model.layers}
        self.model_step = lambda *args: self.declined("model step")
        return "counted"


BLOCK = 4


def run(model: torch.nn.Module, prompt: torch.Tensor, decode: int) -> list[torch.Tensor]:
    """The logits of a prefill of `prompt` [B, T] and of `decode` greedy decode passes after it, over a paged cache
    (each row's blocks its own, as the engine's)."""
    b, t = prompt.shape
    per_row = -(-(t + decode) // BLOCK)
    cache = model.make_cache(b * per_row, BLOCK, BF16, torch.device("cpu"))
    table = torch.arange(b * per_row).view(b, per_row)
    out, ids = [], prompt
    with torch.inference_mode():
        for i in range(decode + 1):
            pos = torch.arange(ids.shape[1]).expand(b, -1) + (0 if i == 0 else t + i - 1)
            paged = (table, table.gather(1, pos // BLOCK), pos % BLOCK)
            logits = model(ids, ForwardBatch.build(pos, paged=paged), cache, torch.full((b,), ids.shape[1] - 1))
            out.append(logits)
            ids = logits.argmax(-1, keepdim=True)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_every_block_computes_with_the_one_backend_the_model_was_built_with(hf_checkpoint, arch):
    """A model built with a backend whose kernels are torch's own arithmetic computes the logits of the model built
    without one, bit for bit; every block holds that one object, every norm and softmax top-k router calls it at every
    pass, and the fused calls it makes are tried first at every decode pass (the model's, then each layer's as the
    model's declines) and, declining, leave the modules to compute."""
    _, path = hf_checkpoint(arch)
    plain = load_model(path, dtype=BF16, show_progress=False, pack_dense=False)
    assert type(plain.model.backend) is Backend
    backend = CountingBackend()
    model = architecture_for(plain.checkpoint.config).build(plain.config, plain.experts, backend)
    cast_model(model, BF16)
    model.load_state_dict(plain.model.state_dict())
    assert backend.fuse(model.eval()) == "counted"
    holders = [m for m in model.modules() if hasattr(m, "backend")]
    assert {id(m.backend) for m in holders} == {id(backend)}
    per_head = sum(isinstance(m, Attention) and m.qk_norm == "head" for m in model.modules())
    norms = sum(isinstance(m, RMSNorm) for m in model.modules()) - per_head  # (q and k heads: the q norm's one call)
    routers = sum(isinstance(m, SoftmaxTopKRouter) for m in model.modules())
    assert norms >= 2 * len(model.model.layers) + 1
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    decode = 3
    for got, ref in zip(run(model, prompt, decode), run(plain.model, prompt, decode), strict=True):
        assert torch.equal(got, ref)
    passes, layers = decode + 1, len(model.model.layers)
    assert backend.calls == +Counter({"norm": norms * passes, "router": routers * passes, "model step": decode,
                                      "layer step": decode * layers})  # (+: no zero counts)


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"no CPU kernels here: {cpu_kernels.unsupported_reason()}")
@pytest.mark.parametrize("arch", ARCHS)
def test_a_bf16_cpu_run_gives_every_block_the_kernels_backend(hf_checkpoint, arch):
    """The builder gives a bf16 CPU model moepager's kernels as its backend, and an fp32 one or a run without the
    packed kernels (--no-packed-dense) torch's ops; either way one object for the whole model."""
    _, path = hf_checkpoint(arch)
    for options, kind in (({"dtype": BF16}, step.KernelBackend), ({"dtype": BF16, "pack_dense": False}, Backend),
                          ({}, Backend)):
        model = load_model(path, show_progress=False, **options).model
        assert type(model.backend) is kind
        assert {id(m.backend) for m in model.modules() if hasattr(m, "backend")} == {id(model.backend)}
        attentions = [m for m in model.modules() if isinstance(m, Attention)]
        assert all((m.backend.attention is not None) == (kind is step.KernelBackend) for m in attentions)
