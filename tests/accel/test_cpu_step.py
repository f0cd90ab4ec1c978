"""moepager's CPU decode-step kernels (accel/csrc/step.h, accel/step.py): the norm, the router and the decode
attention against the torch path they replace, on odd shapes, every q/k norm, GQA grouping,
sliding windows and rows at different lengths; the same result alone or batched; every architecture's engine run;
the fallback.

Tolerances: the norm and RoPE round as the torch path does, so the cache they write is bit-equal to it whenever the
norm's fp32 sum of squares rounds alike (seen: always; allowed: 1 bf16 ulp); the attention's scores, softmax and
value sums are fp32 in another order than SDPA's, then rounded to bf16 once: its output is within 1 bf16 ulp of the
torch path's (2^-7 of the magnitude; 2% of the output's largest magnitude allowed)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from moepager.accel import cpu_kernels, step
from moepager.config import EngineConfig, ExpertFormat
from moepager.models.attention import Attention, ForwardBatch, RMSNorm, RotaryEmbedding
from moepager.models.backend import Backend
from moepager.models.config import ModelConfig, RopeConfig
from moepager.models.layers import CausalLM, DecoderLayer
from moepager.models.moe import SoftmaxTopKRouter
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams, greedy_picks
from tests.conftest import ARCHS

BF16 = torch.bfloat16
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"no CPU kernels here: "
                                   f"{cpu_kernels.unsupported_reason()}")


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps (of b's binade) a and b are apart."""
    _, exponent = torch.frexp(b.float())
    return (a.float() - b.float()).abs() / torch.ldexp(torch.ones(()), exponent - 8)


@pytest.mark.parametrize("n, shape, per_row", [(256, (1, 1), False), (33, (7,), False), (64, (3, 2, 12), True),
                                               (40, (64,), False), (128, (2, 5, 36), True)])
def test_rms_norm_equals_the_torch_norm(n, shape, per_row, tier):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(*shape, n, generator=gen) * 3).to(BF16)
    norm = RMSNorm(n, 1e-6).to(BF16)
    w = (torch.randn(shape[-1] if per_row else 1, n, generator=gen) * 0.5 + 1).to(BF16)
    ref = norm(x, w if per_row else w[0])
    got = cpu_kernels.extension().rms_norm(x, w, 1e-6)
    assert got.shape == ref.shape and got.dtype == BF16
    assert ulps(got, ref).max() <= 1.0
    assert (got == ref).float().mean() >= 0.99
    # a non-contiguous input (the q/k heads of a fused projection) normalises the same
    wide = torch.cat((x, x), dim=-1)[..., :n]
    assert torch.equal(cpu_kernels.extension().rms_norm(wide, w, 1e-6), got)


@pytest.mark.parametrize("n, d, e, k, normalize", [(1, 256, 32, 4, True), (7, 100, 60, 4, False),
                                                   (16, 2048, 128, 8, True), (3, 33, 8, 2, True)])
def test_router_equals_the_torch_router(n, d, e, k, normalize, tier):
    """The same experts with the same weights (fp32: within 1e-7) and probabilities; the order of experts whose
    probabilities tie may differ (torch's top-k leaves it unspecified; ours puts the lower expert first)."""
    torch.manual_seed(n)
    router = SoftmaxTopKRouter(d, e, k, normalize=normalize, fp32_weights=True).to(BF16)
    router.weight.data = (torch.randn(e, d) * 0.05).to(BF16)
    x = torch.randn(n, d).to(BF16)
    torch._C._set_mkldnn_enabled(False)  # torch's own GEMV, as MoEBlock runs a few tokens' router
    try:
        ref = router(x)
    finally:
        torch._C._set_mkldnn_enabled(True)
    router.backend = step.KernelBackend(cpu_kernels.extension())
    got = router(x)
    torch.testing.assert_close(got.scores_TE, ref.scores_TE, rtol=0, atol=1e-7)
    ids, order = got.ids_TK.sort(-1)
    ref_ids, ref_order = ref.ids_TK.sort(-1)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(got.weights_TK.gather(-1, order), ref.weights_TK.gather(-1, ref_order), rtol=0,
                               atol=1e-7)
    assert (got.weights_TK[:, :-1] >= got.weights_TK[:, 1:]).all()


def attention_module(qk_norm, window, heads=6, kv_heads=2, head_dim=40, hidden=96, clip=None, seed=0):
    cfg = ModelConfig("Test", 64, hidden, 1, heads, kv_heads, head_dim, 1e-6, RopeConfig(10000.0, head_dim), 256,
                      True, (0,), 4, 2, 16, 16, sliding_window=window)
    torch.manual_seed(seed)
    attn = Attention(cfg, qkv_bias=True, qk_norm=qk_norm, clip_qkv=clip)
    for p in attn.parameters():
        p.data = (torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0)).to(BF16)
    return attn, RotaryEmbedding(cfg.rope, 256)


def paged_decode(attn, rope, x_BD, positions, cache, table):
    """One decode token a row, through the paged-cache forward (what the engine runs)."""
    pos = torch.tensor(positions)[:, None]
    b, bs = len(positions), cache.shape[1]
    slot_block = table[torch.arange(b), (pos[:, 0] // bs).clamp_max(table.shape[1] - 1)][:, None]
    batch = ForwardBatch.build(pos, paged=(table, slot_block, pos % bs), sliding_window=attn.window)
    with torch.inference_mode():
        return attn(x_BD[:, None], rope(pos, BF16), batch, cache)[:, 0]


@pytest.mark.parametrize("qk_norm, clip", [("head", None), (None, None), ("full", 0.5)])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_equals_the_torch_path(qk_norm, clip, window, tier):
    """Rows at positions 0, 9 and 21 (blocks of 4, scattered), GQA of 3 query heads a KV head, a head dim that is not
    a multiple of 16: the output within the tolerance, the cache written alike."""
    attn, rope = attention_module(qk_norm, window, clip=clip)
    gen = torch.Generator().manual_seed(1)
    blocks, bs, positions = 24, 4, [0, 9, 21]
    table = torch.randperm(blocks, generator=gen)[:18].view(3, 6)
    cache = (torch.randn(blocks, bs, 4, 40, generator=gen)).to(BF16)
    x = torch.randn(3, 96, generator=gen).to(BF16)
    ref_cache, got_cache = cache.clone(), cache.clone()
    ref = paged_decode(attn, rope, x, positions, ref_cache, table)
    attn.backend = step.KernelBackend(cpu_kernels.extension())
    got = paged_decode(attn, rope, x, positions, got_cache, table)
    assert (ulps(got_cache, ref_cache) <= 1.0).all() and (got_cache == ref_cache).float().mean() >= 0.99
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()
    # each row alone: bit for bit what it was batched (its own blocks, the same cache)
    for b, p in enumerate(positions):
        alone = paged_decode(attn, rope, x[b:b + 1], [p], cache.clone(), table[b:b + 1])
        assert torch.equal(alone[0], got[b])


@needs_kernels
def test_decode_attention_rejects_a_position_past_its_blocks():
    attn, rope = attention_module("head", None)
    attn.backend = step.KernelBackend(cpu_kernels.extension())
    cache, table = torch.zeros(8, 4, 4, 40, dtype=BF16), torch.arange(2).view(1, 2)
    with pytest.raises(RuntimeError, match="past the block table"):
        paged_decode(attn, rope, torch.randn(1, 96).to(BF16), [8], cache, table)


def kernel_step(module):
    """What computes the module's decode pass on the kernels: an attention's kernels, a decoder layer's fused call;
    None where it has none."""
    return module.backend.layer_steps.get(module) if isinstance(module, DecoderLayer) else module.backend.attention


@contextmanager
def without_kernel_step(module):
    """Meanwhile the module's decode pass runs without its kernel step: an attention on torch's ops (a backend of
    its own), a decoder layer through its modules (its fused call set aside)."""
    if isinstance(module, DecoderLayer):
        fused = module.backend.layer_steps.pop(module)
        try:
            yield
        finally:
            module.backend.layer_steps[module] = fused
    else:
        backend, module.backend = module.backend, Backend()
        try:
            yield
        finally:
            module.backend = backend


@contextmanager
def without_fused_calls(model):
    """Meanwhile each module computes by itself: no decoder layer's or whole model's fused call."""
    backend = model.backend
    layers, whole = dict(backend.layer_steps), backend.model_step
    backend.layer_steps.clear()
    backend.model_step = None
    try:
        yield
    finally:
        backend.layer_steps.update(layers)
        backend.model_step = whole


def compare_decode_passes(monkeypatch, cls, check, direct: bool = False) -> list[int]:
    """Patch `cls.forward`: every decode pass of a module with a kernel step (`kernel_step`) runs twice on copies of its
    cache, without the step (the reference) and with it (the step called itself where `direct`: it must not decline),
    and `check(got, ref, got_cache, ref_cache)` compares them; then the pass runs as usual. Returns the compared
    passes' row counts (filled as the engine runs)."""
    forward, rows = cls.forward, []

    def both(self, x, rope, batch, cache):
        step = kernel_step(self)
        if step is not None and x.shape[1] == 1:
            ref_cache, got_cache = cache.clone(), cache.clone()
            with without_kernel_step(self):
                ref = forward(self, x, rope, batch, ref_cache)
            got = step(x, rope, batch, got_cache) if direct else forward(self, x, rope, batch, got_cache)
            check(got, ref, got_cache, ref_cache)
            rows.append(x.shape[0])
        return forward(self, x, rope, batch, cache)

    monkeypatch.setattr(cls, "forward", both)
    return rows


@needs_kernels
@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_decodes_through_the_kernels_as_through_torch(hf_checkpoint, arch, monkeypatch):
    """Two prompts batched through the engine (paged cache, decode passes of two rows at different lengths), greedy:
    at every decode pass each attention layer's output through the kernel is the torch path's within the tolerance,
    and so is the cache it writes; the run says the kernels ran. (The greedy tokens themselves are not compared: these
    random models have near-ties, logits 1e-3 apart, that a last-bit difference flips.)"""
    _, path = hf_checkpoint(arch)
    llm = LLM(path, dtype="bfloat16", show_progress=False)
    note = llm.loaded.dense_format
    assert "norms" in note and "moepager's CPU kernels" in note
    assert ("routers" in note) == any(isinstance(m, SoftmaxTopKRouter) for m in llm.loaded.model.modules())

    def close(got, ref, got_cache, ref_cache):
        assert (got - ref).abs().max() <= 0.02 * ref.abs().max()
        assert (ulps(got_cache, ref_cache) <= 1.0).all()

    compared = compare_decode_passes(monkeypatch, Attention, close)
    with without_fused_calls(llm.loaded.model):  # the modules one by one (the whole-layer and whole-model calls: the
        outs = llm.generate([[3, 5, 7, 11, 13], [17, 19]],  # next tests)
                            SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [5, 5]
    uses_attention = any(isinstance(m, Attention) for m in llm.loaded.model.modules())
    assert (2 in compared) == uses_attention  # (DeepSeek's MLA has an attention of its own: norms only)


@needs_kernels
@pytest.mark.parametrize("arch, threads, expert_dtype", [(a, 2, None) for a in ARCHS]
                         + [("qwen3_moe", 1, None), ("mixtral", 1, "int8"), ("qwen3_moe", 2, "int8")])
def test_a_whole_layer_in_one_call_equals_its_modules_bit_for_bit(hf_checkpoint, arch, threads, expert_dtype,
                                                                   monkeypatch):
    """Where a decoder layer's parts all have kernels (Mixtral, Qwen3-MoE: no shared experts, no clip), its decode pass
    is one call; through the engine (two rows at different lengths, greedy) every such call's output and cache equal
    the layer's modules' with the same kernels, bit for bit, on one thread and on two (the call's own parallel region
    shares each step's tasks among them), bf16 or int8 experts. It declines where it cannot be the modules'
    arithmetic: an observer on the block (a trace recorder) runs the modules."""
    keeping_threads(run_whole_layer_test, hf_checkpoint(arch)[1], arch, threads, expert_dtype, monkeypatch)


def keeping_threads(run, *args) -> None:
    """`run(*args)` (which sets torch's thread count through the LLM), the count put back after."""
    before = torch.get_num_threads()
    try:
        run(*args)
    finally:
        torch.set_num_threads(before)


def run_whole_layer_test(path, arch, threads, expert_dtype, monkeypatch):
    llm = LLM(config=EngineConfig(model=str(path), dtype="bfloat16", threads=threads,
                                  experts=ExpertFormat(expert_dtype)),
              show_progress=False)
    assert torch.get_num_threads() == threads
    layers = [m for m in llm.loaded.model.modules() if isinstance(m, DecoderLayer)]
    backend = llm.loaded.model.backend
    fused = [layer for layer in layers if layer in backend.layer_steps]
    assert (len(fused) > 0) == (arch in ("mixtral", "qwen3_moe"))
    assert ("whole decoder layers" in llm.loaded.dense_format) == bool(fused)
    backend.model_step = None  # each layer's own call (the whole model's: the next test)

    def equal(got, ref, got_cache, ref_cache):
        assert got is not None and torch.equal(got, ref) and torch.equal(got_cache, ref_cache)

    calls = compare_decode_passes(monkeypatch, DecoderLayer, equal, direct=True)
    llm.generate([[3, 5, 7, 11, 13], [17, 19]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert (2 in calls) == bool(fused)
    if fused:
        block = fused[0].mlp
        monkeypatch.setattr(block, "observer", object())  # (a trace recorder's place)
        x = torch.randn(1, 1, llm.loaded.config.hidden_size).to(BF16)
        assert backend.layer_steps[fused[0]](x, None, None, None) is None  # declines before reading anything else


@needs_kernels
@pytest.mark.parametrize("arch, threads, expert_dtype", [(a, 2, None) for a in ARCHS]
                         + [("qwen3_moe", 1, None), ("mixtral", 1, "int8"), ("qwen3_moe", 2, "int4")])
def test_a_whole_decode_pass_in_one_call_equals_the_modules_bit_for_bit(hf_checkpoint, arch, threads, expert_dtype,
                                                                         monkeypatch, request):
    """Where every decoder layer has its one call (Mixtral, Qwen3-MoE), a decode pass of the whole model is one call
    (embedding, layers, final norm, LM head); through the engine (two rows at different lengths, greedy) its logits and
    every layer's cache equal the modules' (each layer by its own call) bit for bit, on one thread and two, bf16, int8
    or int4 experts, also when the rotary tables must grow first. It declines where the modules would do more than it:
    a forward hook on any module it skips, an observer on a block; a token outside the vocabulary is an error. (int4:
    the Qwen3-MoE whose experts are 32 wide, a group.)"""
    path = request.getfixturevalue("bf16_checkpoint") if expert_dtype == "int4" else hf_checkpoint(arch)[1]
    keeping_threads(run_whole_model_test, path, arch, threads, expert_dtype, monkeypatch)


def run_whole_model_test(path, arch, threads, expert_dtype, monkeypatch):
    llm = LLM(config=EngineConfig(model=str(path), dtype="bfloat16", threads=threads,
                                  experts=ExpertFormat(expert_dtype)), show_progress=False)
    model = llm.loaded.model
    whole = model.backend.model_step
    assert isinstance(whole, step.DecodeModelStep) == (arch in ("mixtral", "qwen3_moe"))
    assert ("whole decode step" in llm.loaded.dense_format) == (whole is not None)
    if whole is None:
        return
    forward, rows = CausalLM.forward, []

    def both(self, ids, batch, cache, logits_at_B=None):
        if logits_at_B is not None and ids.shape[1] == 1:
            ref_cache, got_cache = [c.clone() for c in cache], [c.clone() for c in cache]
            self.backend.model_step = None
            ref = forward(self, ids, batch, ref_cache, logits_at_B)
            self.backend.model_step = whole
            if not rows:
                self.model.rotary_emb._tables.clear()  # the call grows them itself
            got = whole(ids, batch, got_cache)
            assert got is not None and torch.equal(got, ref)
            assert all(torch.equal(g, r) for g, r in zip(got_cache, ref_cache))
            rows.append(ids.shape[0])
        return forward(self, ids, batch, cache, logits_at_B)

    monkeypatch.setattr(CausalLM, "forward", both)
    llm.generate([[3, 5, 7, 11, 13], [17, 19]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert 2 in rows
    monkeypatch.undo()
    assert whole.usable()
    layer = model.model.layers[-1]
    for module in (layer, layer.mlp, model.model.norm, model.lm_head):
        handle = module.register_forward_hook(lambda *args: None)
        assert not whole.usable()
        handle.remove()
    monkeypatch.setattr(layer.mlp, "observer", object())  # (a trace recorder's place)
    assert not whole.usable()
    monkeypatch.undo()
    assert whole.usable()
    cache = model.make_cache(1, 16, BF16, torch.device("cpu"))
    vocab = model.model.embed_tokens.weight.shape[0]
    cos, sin = model.model.rotary_emb._tables[BF16]
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        whole.call(torch.tensor([vocab]), torch.tensor([0]), cos, sin, cache, torch.zeros(1, 2, dtype=torch.long),
                   whole.executor.kernels.arena)


def test_without_the_extension_the_model_keeps_torch_ops(monkeypatch):
    """No extension (no AVX-512, no compiler, MOEPAGER_CPU_KERNELS=0): nothing is replaced and the run is the torch
    path's; an fp32 run is never given the kernels."""
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    llm = LLM(config=EngineConfig(), show_progress=False)
    model = llm.loaded.model
    assert all(m.backend.rms_norm is None for m in model.modules() if isinstance(m, RMSNorm))
    assert all(m.backend.attention is None for m in model.modules() if isinstance(m, Attention))
    assert len(llm.generate(["Once"], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4
    monkeypatch.undo()
    fp32 = step.step_backend(torch.float32, torch.device("cpu"))
    assert fp32.rms_norm is None and fp32.router_topk is None and fp32.attention is None and fp32.fuse(model) == ""


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 7, 33, 8192, 151936])
def test_greedy_picks_equal_torch_s(dtype, vocab, monkeypatch, tier):
    """The sampler's one-call greedy pick: each row's first largest logit (ties included) and whether it is finite
    (NaN, +inf and -inf each make a row non-finite), as torch's five ops say."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    logits[1, vocab // 2] = logits[1, -1] = logits[1].max()
    if vocab > 3:
        logits[2, 3], logits[3, 0], logits[4, vocab - 1] = float("nan"), float("inf"), float("-inf")
    got = greedy_picks(logits)
    monkeypatch.setattr(cpu_kernels, "built", lambda: None)
    ref = greedy_picks(logits)
    assert got[1] == ref[1]
    assert [t for t, ok in zip(*got) if ok] == [t for t, ok in zip(*ref) if ok]
