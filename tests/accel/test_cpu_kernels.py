"""moepager's fused CPU expert kernels (accel/cpu_kernels.py, accel/csrc/): each format against an fp32
reference on odd shapes and token counts, paged equal to resident bit for bit, every architecture's logits against
torch's kernels, and the fallback when the extension cannot be used.

Tolerances (stated in accel/cpu_kernels.py): bf16 experts differ from the fp32 reference on the same weights by the
bf16 rounding of the activation and output (measured <= 0.4% of the output's largest magnitude: 1% allowed); int8 and
int4 experts also quantize the activations to 8 bits in blocks of 32 (measured <= 1.6%: 3% allowed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moepager.accel import cpu_kernels, cpu_tiers, ops
from moepager.accel.packed import FusedLinear
from moepager.checkpoints.quantized import quantize_checkpoint
from moepager.config import StoreConfig
from moepager.errors import ConfigError
from moepager.experts.executor import PagedExecutor, ResidentExecutor
from moepager.experts.quant import QuantExpertWeights, QuantFormat, quantize_expert, sections
from moepager.experts.weights import ExpertShape
from moepager.loading.build import LoadOptions, open_checkpoint, resident_executor
from moepager.models.attention import Attention
from moepager.placements.paged import paged_executor
from moepager.placements.stores import STREAM_ROWS, read_buffer_bytes
from moepager.runtime.builder import load_model
from moepager.types import RoutingDecision
from tests.conftest import ARCHS, OUR_TIERS
from tests.runtime.test_offload import logits_run

BF16, CPU = torch.bfloat16, torch.device("cpu")
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"no fused CPU kernels here: "
                                   f"{cpu_kernels.unsupported_reason()}")
TOLERANCE = {"bf16": 0.01, "int8": 0.03, "int4": 0.03}


def make_layer(fmt: str, d: int, f: int, e: int, seed: int = 0
               ) -> tuple[torch.Tensor, ExpertShape, list[tuple[torch.Tensor, torch.Tensor]]]:
    """An arena of `e` experts in `fmt` and each expert's fp32 weights as the format holds them."""
    g = torch.Generator().manual_seed(seed)
    raw = [(torch.randn(2 * f, d, generator=g) * 0.1, torch.randn(d, f, generator=g) * 0.1) for _ in range(e)]
    if fmt == "bf16":
        shape = ExpertShape(d, f, BF16)
        arena = torch.stack([torch.cat([gu.to(BF16).flatten(), dn.to(BF16).flatten()]) for gu, dn in raw])
        return arena, shape, [(gu.to(BF16).float(), dn.to(BF16).float()) for gu, dn in raw]
    quant = QuantFormat(8) if fmt == "int8" else QuantFormat(4, 32, False, "rows")
    shape = ExpertShape(d, f, BF16, quant)
    arena = torch.zeros(e, sections(d, f, BF16, quant)[1], dtype=torch.uint8)
    weights = []
    for row, (gu, dn) in enumerate(raw):
        view = QuantExpertWeights(arena[row], d, f, BF16, quant)
        quantize_expert(gu, dn, view, BF16)
        weights.append(view.dequantized())
    return arena, shape, weights


def reference(x: torch.Tensor, route: RoutingDecision, weights: list[tuple[torch.Tensor, torch.Tensor]]
              ) -> torch.Tensor:
    out = torch.zeros(x.shape[0], weights[0][1].shape[0])
    for t in range(x.shape[0]):
        for k in range(route.ids_TK.shape[1]):
            gu, dn = weights[int(route.ids_TK[t, k])]
            h = gu @ x[t].float()
            f = dn.shape[1]
            out[t] += route.weights_TK[t, k].float() * (dn @ (F.silu(h[:f]) * h[f:]))
    return out


def random_route(n: int, e: int, k: int, seed: int = 1) -> RoutingDecision:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    return RoutingDecision(ids, torch.softmax(torch.randn(n, k, generator=g), -1).to(BF16), None)


@pytest.mark.parametrize("fmt, d, f", [("bf16", 100, 72), ("bf16", 256, 128), ("int8", 100, 72), ("int8", 192, 200),
                                       ("int4", 96, 64), ("int4", 256, 160)])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_a_fused_layer_computes_the_reference_on_odd_shapes(fmt, d, f, tokens, tier):
    """Rows and inputs that are not multiples of 16, 32, 64 or 128; one token, a few, a prefill's worth; every tier."""
    e, k = 8, 3
    arena, shape, weights = make_layer(fmt, d, f, e)
    route = random_route(tokens, e, k)
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(2)).to(BF16)
    executor = ResidentExecutor(arena, shape, [0], e, "fused", cpu_kernels.FusedExperts(shape, 1 << 62))
    got = executor.run(0, x, route)
    ref = reference(x, route, weights)
    assert got.dtype == BF16 and got.shape == (tokens, d)
    assert (got.float() - ref).abs().max() <= TOLERANCE[fmt] * ref.abs().max()


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_computing_a_layer_in_pieces_as_experts_land_gives_the_one_call_bits(fmt, tier):
    e, k, n = 8, 3, 5
    arena, shape, _ = make_layer(fmt, 128, 96, e)
    fused = cpu_kernels.FusedExperts(shape, 1 << 62)
    route = random_route(n, e, k)
    x = torch.randn(n, 128, generator=torch.Generator().manual_seed(2)).to(BF16)
    whole = fused.resident(x, route.ids_TK, route.weights_TK, arena, 0, e)
    order = torch.argsort(route.ids_TK.flatten(), stable=True)
    token, w = order // k, route.weights_TK.flatten()[order].float()
    used, counts = torch.unique(route.ids_TK, return_counts=True)
    ends = counts.cumsum(0)
    spans = torch.stack([ends - counts, ends], 1)
    y = torch.empty(n * k, 128)
    for part in (slice(1, None, 2), slice(0, None, 2)):  # the odd experts land first
        fused.module.moe_partial(x, arena, token, w, used[part].contiguous(), spans[part].contiguous(), y,
                                **fused.format)
    assert torch.equal(fused.combine(y, token, n), whole)


def test_the_format_spec_is_passed_by_name_and_checked(tier):
    """The operators take an expert format's fields as keyword-only arguments named as `FormatSpec`'s (csrc/bind.h
    `MOEPAGER_FORMAT_SCHEMA`): passed positionally, with a field left out or misnamed, the dispatcher refuses the
    call, and a spec the kernels cannot compute is refused with what is wrong."""
    e, k, n = 4, 2, 3
    arena, shape, _ = make_layer("int4", 128, 96, e)
    fused = cpu_kernels.FusedExperts(shape, 1 << 62)
    spec = fused.spec
    assert spec == ops.FormatSpec(ops.FORMAT_CODES["int4"], 128, 96, 32, *(
        s.offset for s in sections(128, 96, BF16, shape.quant)[0]))
    schema = fused.module.moe_resident._schema
    assert [a.name for a in schema.arguments if a.kwarg_only] == list(spec._fields)
    route = random_route(n, e, k)
    x = torch.randn(n, 128, generator=torch.Generator().manual_seed(3)).to(BF16)
    whole = fused.resident(x, route.ids_TK, route.weights_TK, arena, 0, e)
    args = (x, route.ids_TK, route.weights_TK, arena, 0, e)
    assert torch.equal(fused.module.moe_resident(*args, **spec._replace()._asdict()), whole)
    with pytest.raises(RuntimeError, match="takes 6 positional argument"):
        fused.module.moe_resident(*args, *spec)
    with pytest.raises(RuntimeError, match="down_scales"):
        fused.module.moe_resident(*args, **{f: v for f, v in spec._asdict().items() if f != "down_scales"})
    with pytest.raises(RuntimeError, match="hidden"):
        fused.module.moe_resident(*args, **{("hiden" if f == "hidden" else f): v for f, v in spec._asdict().items()})
    for bad, why in ((spec._replace(fmt=7), "unknown expert format 7"), (spec._replace(group=48), "int4 groups"),
                     (spec._replace(hidden=0), "D and F must be positive")):
        with pytest.raises(RuntimeError, match=why):
            fused.module.moe_resident(*args, **bad._asdict())


@needs_kernels
@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_computes_torchs_logits_with_the_fused_kernel(hf_checkpoint, arch):
    _, path = hf_checkpoint(arch)
    got = load_model(path, dtype=BF16, executor_factory=resident_executor(CPU, "fused"), show_progress=False)
    assert got.experts.kernels.fused is not None and "fused CPU kernel" in got.expert_format
    ref = load_model(path, dtype=BF16, executor_factory=resident_executor(CPU, "loop"), show_progress=False)
    assert ref.experts.kernels.fused is None
    for a, b in zip(logits_run(got, rows=2), logits_run(ref, rows=2)):  # prefill of two rows, then decodes
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)


@needs_kernels
@pytest.mark.parametrize("expert_dtype", ["int8", "int4"])
def test_quantized_experts_take_the_fused_kernel_in_its_layout_by_default(bf16_checkpoint, expert_dtype):
    """auto holds int4 in the kernel's 'rows' layout, says the activations are quantized, and stays close to the
    weight-only torch kernels (the activations' quantization is the difference)."""
    path = bf16_checkpoint
    got = load_model(path, dtype=BF16, expert_dtype=expert_dtype, show_progress=False)
    assert isinstance(got.experts, ResidentExecutor) and got.experts.kernels.fused is not None
    assert "activations quantized to 8 bits in blocks of 32" in got.expert_format
    if expert_dtype == "int4":
        assert got.expert_shape.quant.layout == "rows"
    ref = load_model(path, dtype=BF16, expert_dtype=expert_dtype, expert_kernel="loop",
                     executor_factory=resident_executor(CPU, "loop"), show_progress=False)
    assert ref.experts.kernels.fused is None and ref.expert_format == ref.expert_shape.format_name
    assert expert_dtype == "int8" or ref.expert_shape.quant.layout == "cpu"
    for a, b in zip(logits_run(got, rows=2), logits_run(ref, rows=2)):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.08, atol=0.08)


@needs_kernels
@pytest.mark.parametrize("expert_dtype", [None, "int8", "int4"])
def test_paged_fused_layers_give_the_resident_runs_bits(bf16_checkpoint, tmp_path, expert_dtype):
    path = bf16_checkpoint  # bf16 on disk: float experts are read as they lie
    if expert_dtype is not None:  # quantized on disk: the store reads quantized bytes
        path = quantize_checkpoint(bf16_checkpoint, tmp_path / expert_dtype, expert_dtype, show_progress=False)
    resident = load_model(path, show_progress=False)
    assert resident.experts.kernels.fused is not None
    ref = logits_run(resident, steps=6, rows=1)  # one token a step: the decode path
    nbytes, defaults = resident.expert_shape.nbytes, StoreConfig()
    reserved = read_buffer_bytes(open_checkpoint(path, LoadOptions()).reader, defaults.io_threads,
                                 defaults.prefetch_threads)
    config = StoreConfig(expert_memory=str((3 + STREAM_ROWS) * nbytes + reserved), warm=False)
    paged = load_model(path, executor_factory=paged_executor(config, CPU), show_progress=False)
    assert isinstance(paged.experts, PagedExecutor) and paged.experts.kernels.fused is not None
    assert all(torch.equal(a, b) for a, b in zip(logits_run(paged, steps=6, rows=1), ref))
    assert sum(p.loads_on_demand for p in paged.experts.store.counters.phases.values()) > 0
    paged.experts.store.close()


@pytest.fixture
def fresh_state(monkeypatch):
    """The kernels chosen anew (and the real choice restored after the test)."""
    monkeypatch.setattr(cpu_kernels, "_state", None)
    monkeypatch.delenv("MOEPAGER_CPU_TIER", raising=False)
    monkeypatch.delenv("MOEPAGER_CPU_KERNELS", raising=False)


def test_without_a_compiler_runs_fall_back_to_torch_and_say_why(fresh_state, monkeypatch, capsys, bf16_checkpoint):
    monkeypatch.setattr(cpu_kernels, "unsupported_reason", lambda: "no C++ compiler (c++) on PATH")
    assert cpu_kernels.extension() is None and cpu_kernels.tier() == "torch"
    assert capsys.readouterr().err.count("\n") == 1  # one line
    assert cpu_kernels.status() == "torch's (ours unavailable: no C++ compiler (c++) on PATH)"
    shape = ExpertShape(64, 64, BF16)
    assert cpu_kernels.fused_experts(shape, CPU, "auto") is None
    with pytest.raises(ConfigError, match="cannot compute these bfloat16 experts: no C\\+\\+ compiler"):
        cpu_kernels.fused_experts(shape, CPU, "fused")
    loaded = load_model(bf16_checkpoint, expert_dtype="int4", show_progress=False)
    assert loaded.experts.kernels.fused is None and loaded.expert_shape.quant.layout == "cpu"  # torch's int4 layout
    assert "compiler" not in capsys.readouterr().err  # said once per process (a CPU without AVX-512 may say here,
    # once, that oneDNN's bf16 prepack is unavailable: a line of its own, not this one)


def test_moepager_cpu_kernels_0_turns_the_extension_off_silently(fresh_state, monkeypatch, capsys):
    monkeypatch.setenv("MOEPAGER_CPU_KERNELS", "0")
    assert cpu_kernels.extension() is None and capsys.readouterr().err == ""
    assert cpu_kernels.status() == "torch's (ours unavailable: MOEPAGER_CPU_KERNELS=0)"


def test_a_failed_build_falls_back_to_the_next_tier_with_its_reason(fresh_state, monkeypatch, capsys):
    if len(OUR_TIERS) < 2:
        pytest.skip("this CPU runs one tier of ours: nothing to fall back to but torch (the next test)")
    native, build = OUR_TIERS[0], cpu_kernels._build

    def broken(tier):
        if tier.name == native:
            raise RuntimeError("Error building extension 'moepager_cpu'\nc++: fatal error: no input files")
        return build(tier)

    monkeypatch.setattr(cpu_kernels, "_build", broken)
    monkeypatch.setattr(cpu_kernels, "_modules", {})
    assert cpu_kernels.tier() == OUR_TIERS[1] and cpu_kernels.extension().tier == OUR_TIERS[1]
    err = "".join(line for line in capsys.readouterr().err.splitlines(True) if "building the CPU kernels" not in line)
    assert err.count("\n") == 1 and f"moepager: CPU kernels: {OUR_TIERS[1]} (the {native} build failed (c++: fatal " \
        "error: no input files))" in err
    assert f"not a higher tier: the {native} build failed" in cpu_kernels.status()


def test_when_every_build_fails_torchs_kernels_run_with_the_reasons(fresh_state, monkeypatch, capsys):
    def broken(tier):
        raise RuntimeError(f"c++: no {tier.name} today")

    monkeypatch.setattr(cpu_kernels, "_build", broken)
    monkeypatch.setattr(cpu_kernels, "_modules", {})
    assert cpu_kernels.extension() is None and cpu_kernels.tier() == "torch"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moepager: CPU expert kernels unavailable, using torch's: the ")
    assert all(f"c++: no {t} today" in err for t in OUR_TIERS)


def test_a_build_whose_self_test_computes_other_bits_is_not_used(fresh_state, monkeypatch, capsys):
    """A build that runs but computes wrong bits (a stale cache, a compiler bug, a CPU that lies about a feature) is
    found by the self-test in a forked child, and the next tier runs."""
    monkeypatch.setattr(cpu_kernels, "SELFTEST", cpu_kernels.SELFTEST + 1)
    monkeypatch.setattr(cpu_kernels, "_modules", {})
    assert cpu_kernels.extension() is None
    assert f"the {OUR_TIERS[0]} build cannot run here: its self-test computed the wrong bits" in capsys.readouterr().err


def test_a_build_lock_left_by_a_killed_build_is_removed_and_builds_take_turns(monkeypatch, tmp_path, capsys):
    """torch's `lock` file, left by a build that was killed, would make every later build wait forever: the build,
    holding moepager's flock (which a dead holder releases), removes it; a second build waits for the flock."""
    import fcntl

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("MOEPAGER_CACHE", str(tmp_path))
    tier = cpu_tiers.BY_NAME["portable"]
    build = cpu_kernels.build_dir(tier)
    build.mkdir(parents=True)
    (build / "lock").touch()
    seen = {}

    def load(name, sources, build_directory, **kwargs):  # noqa: ANN001, ANN202, ARG001
        with open(build / "moepager.flock") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen["turn held"] = False
            except BlockingIOError:
                seen["turn held"] = True
        seen["stale lock"] = (build / "lock").exists()
        return "module"

    monkeypatch.setattr(cpp_extension, "load", load)
    assert cpu_kernels._build(tier) == "module"
    assert seen == {"turn held": True, "stale lock": False}
    assert f"removing {build / 'lock'}" in capsys.readouterr().err


def test_formats_the_fused_kernel_cannot_compute_are_refused_by_name():
    assert "computes in bf16" in cpu_kernels.unsupported_format(ExpertShape(64, 64, torch.float32))
    assert "zero points" in cpu_kernels.unsupported_format(ExpertShape(64, 64, BF16, QuantFormat(4, 32, True,
                                                                                                   "plain")))
    assert "'rows' layout" in cpu_kernels.unsupported_format(ExpertShape(64, 64, BF16, QuantFormat(4, 32)))
    assert cpu_kernels.unsupported_format(ExpertShape(64, 64, BF16, QuantFormat(4, 64, False, "rows"))) is None
    with pytest.raises(ConfigError, match="runs on the CPU"):
        cpu_kernels.fused_experts(ExpertShape(64, 64, BF16), torch.device("meta"), "fused")


@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_rows_int4_layout_round_trips_through_an_experts_buffer(group):
    """The fused kernel's int4 layout holds the same weights as the plain one (dequantized by torch's path)."""
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(256, 128, generator=g), torch.randn(128, 128, generator=g)
    out = []
    for layout in ("plain", "rows"):
        fmt = QuantFormat(4, group, False, layout)
        view = QuantExpertWeights(torch.zeros(sections(128, 128, BF16, fmt)[1], dtype=torch.uint8), 128, 128, BF16,
                                  fmt)
        quantize_expert(gate_up, down, view, BF16)
        out.append(view.dequantized())
    assert all(torch.equal(a, b) for a, b in zip(*out))


def test_the_stream_read_helper_reads_every_byte(tier):
    x = torch.arange(1 << 16, dtype=torch.int64)
    assert cpu_kernels.extension().stream_read(x) == int(x.sum())


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_a_fused_dense_projection_computes_the_linear_map(rows, bias, tier):
    """Up to FUSED_DENSE_MAX_TOKENS rows on moepager's GEMV, more on torch's GEMM; odd sizes, leading dimensions."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(203, 100, generator=g).to(BF16)
    b = torch.randn(203, generator=g).to(BF16) if bias else None
    x = torch.randn(1, rows, 100, generator=g).to(BF16)
    y = FusedLinear(w, b)(x)
    assert y.shape == (1, rows, 203) and y.dtype == BF16
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1.6e-2, atol=1e-2)  # bf16: the last bit may differ


@pytest.mark.parametrize("k", [64, 100, 256])
def test_a_one_row_projection_equals_that_row_in_a_batch_bit_for_bit(k, tier):
    """One input runs its weight rows two at a time (rows.h `dot_bf16_rows<2, 1>`, an odd row count's last alone), a
    batch one row at a time: the same operations in the same order, so the same bits (a whole 64-input chunk, and
    tails)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(203, k, generator=g).to(BF16)
    x = torch.randn(3, k, generator=g).to(BF16)
    lin = FusedLinear(w)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(3)])
    assert torch.equal(alone, lin(x)) and torch.equal(alone[1:2], lin(x[1:2]))


@needs_kernels
def test_loading_puts_every_bf16_dense_projection_on_the_gemv(hf_checkpoint):
    _, path = hf_checkpoint("qwen3_moe")
    loaded = load_model(path, dtype=BF16, show_progress=False)
    model = loaded.model
    assert isinstance(model.lm_head, FusedLinear) and "on moepager's CPU GEMV" in loaded.dense_format
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    assert attn and all(isinstance(a.qkv, FusedLinear) and isinstance(a.o_proj, FusedLinear) for a in attn)
    plain = load_model(path, dtype=BF16, show_progress=False, pack_dense=False)
    assert not any(isinstance(m, FusedLinear) for m in plain.model.modules())
    for a, b in zip(logits_run(loaded, rows=2), logits_run(plain, rows=2)):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)
