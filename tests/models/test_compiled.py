"""The compiled one-token decode step (`--compile`): the eager step's logits and greedy tokens, the graph run whole
(no eager MoE call while decoding), the eager step wherever routing is recorded or replayed, and a clear error
wherever it cannot apply. Each compile takes tens of seconds on 2 cores: one architecture in the default suite,
the others marked slow."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moepager.config import EngineConfig, StoreConfig
from moepager.errors import ConfigError
from moepager.experts.executor import ResidentExecutor
from moepager.experts.weights import ExpertShape
from moepager.models import compiled, packed
from moepager.models.compiled import check_compilable, compile_decode
from moepager.models.load import load_model
from moepager.models.packed import PackedLinear, packing_available
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from moepager.trace.format import TraceReader
from tests.conftest import ARCHS, expert_budget
from tests.runtime.test_offload import logits_run

CPU = torch.device("cpu")


@pytest.mark.parametrize("arch", [pytest.param(a, marks=() if a == "qwen3_moe" else pytest.mark.slow) for a in ARCHS])
def test_a_compiled_decode_step_computes_the_eager_logits(hf_checkpoint, arch):
    _, path = hf_checkpoint(arch)
    ref = logits_run(load_model(path, show_progress=False), steps=5, rows=1)  # fp32: prefill, then 5 decodes
    loaded = load_model(path, show_progress=False)
    compile_decode(loaded.model, loaded.experts, loaded.expert_shape, loaded.device)
    got = logits_run(loaded, steps=5, rows=1)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert [int(x.argmax()) for x in got] == [int(x.argmax()) for x in ref]


def test_the_engine_decodes_through_the_compiled_graph_and_records_routing_eagerly(demo_checkpoint, tmp_path,
                                                                                    monkeypatch):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    eager = LLM(config=EngineConfig(model=str(demo_checkpoint)), show_progress=False)
    llm = LLM(config=EngineConfig(model=str(demo_checkpoint), compile=True), show_progress=False)
    assert llm.loaded.model.compiled_decode is not None and eager.loaded.model.compiled_decode is None
    calls = []
    run = ResidentExecutor.run
    monkeypatch.setattr(ResidentExecutor, "run", lambda self, *a: calls.append(a[0]) or run(self, *a))
    want = eager.generate("a b c", params)[0].token_ids
    layers = len(llm.loaded.config.moe_layers)
    assert len(calls) == 12 * layers  # the eager model: a prefill and 11 decodes, each through every MoE layer
    calls.clear()
    assert llm.generate("a b c", params)[0].token_ids == want
    assert len(calls) == layers  # the prefill only: every decode ran the compiled graph
    calls.clear()
    trace = tmp_path / "t.mpt"
    assert llm.generate("a b c", params, record_trace=trace)[0].token_ids == want
    assert len(calls) == 12 * layers  # recording reads every routing decision on the host: the eager step
    with TraceReader(trace) as reader:
        recorded = reader.request(0)
    assert recorded.num_tokens == len(llm.encode("a b c")) + 11 and (recorded.ids_TLK >= 0).all()
    calls.clear()
    assert llm.generate("a b c", params)[0].token_ids == want and len(calls) == layers  # compiled again after


@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")
def test_a_large_bf16_lm_head_runs_prepacked_after_the_graph(hf_checkpoint, monkeypatch):
    """The graph ends at the final norm; a bf16 head at least PACK_MIN_ELEMENTS large (here: any) is prepacked and
    runs after it, while every other projection keeps its plain weights for Inductor to trace."""
    monkeypatch.setattr(packed, "PACK_MIN_ELEMENTS", 0)
    _, path = hf_checkpoint("qwen3_moe")
    ref = logits_run(load_model(path, torch.bfloat16, show_progress=False, pack_dense=False), steps=3, rows=1)
    loaded = load_model(path, torch.bfloat16, show_progress=False, pack_dense=False)
    compile_decode(loaded.model, loaded.experts, loaded.expert_shape, loaded.device)
    assert isinstance(loaded.model.lm_head, PackedLinear)
    assert sum(isinstance(m, PackedLinear) for m in loaded.model.modules()) == 1
    for a, b in zip(logits_run(loaded, steps=3, rows=1), ref):
        assert (a.float() - b.float()).norm() < 0.02 * b.float().norm()  # bf16: other rounding, same map


def test_int8_experts_decode_through_the_compiled_graph(demo_checkpoint, monkeypatch):
    """int8 experts are copied out of the arena and converted inside the graph (ArenaKernels._gathered_swiglu):
    the eager int8 run's greedy tokens, and no eager MoE call while decoding."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    config = EngineConfig(model=str(demo_checkpoint), expert_dtype="int8")
    want = LLM(config=config, show_progress=False).generate("a b c", params)[0].token_ids
    llm = LLM(config=replace(config, compile=True), show_progress=False)
    calls = []
    run = ResidentExecutor.run
    monkeypatch.setattr(ResidentExecutor, "run", lambda self, *a: calls.append(a[0]) or run(self, *a))
    assert llm.generate("a b c", params)[0].token_ids == want
    assert len(calls) == len(llm.loaded.config.moe_layers)  # the prefill only


def test_compile_refuses_what_it_cannot_run(demo_checkpoint, monkeypatch):
    shape = ExpertShape(256, 64, torch.bfloat16)
    resident = ResidentExecutor(torch.zeros(2, shape.numel, dtype=torch.bfloat16), shape, [0], 2)
    with pytest.raises(ConfigError, match="runs on the CPU"):
        check_compilable(resident, shape, torch.device("cuda"))
    monkeypatch.setattr(compiled, "COMPILE_MAX_EXPERT_BYTES", shape.nbytes - 1)
    with pytest.raises(ConfigError, match=r"experts up to 0 MiB.*0\.1 MiB each"):
        check_compilable(resident, shape, CPU)
    monkeypatch.undo()

    def no_compiler():
        raise RuntimeError("no working C++ compiler found")
    monkeypatch.setattr("torch._inductor.cpp_builder.get_cpp_compiler", no_compiler)
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler.*install g\\+\\+"):
        check_compilable(resident, shape, CPU)
    monkeypatch.undo()
    budget = expert_budget(load_model(demo_checkpoint, show_progress=False).expert_shape.nbytes, 4)
    with pytest.raises(ConfigError, match="every expert resident"):
        LLM(config=EngineConfig(model=str(demo_checkpoint), compile=True, store=StoreConfig(expert_memory=budget)),
            show_progress=False)
    with pytest.raises(ConfigError, match="float and int8 experts; these are int4"):
        LLM(config=EngineConfig(model=str(demo_checkpoint), compile=True, expert_dtype="int4"), show_progress=False)
    with pytest.raises(ConfigError, match="every expert resident"):
        LLM(config=EngineConfig(model=str(demo_checkpoint), compile=True, expert_kernel="packed", dtype="bfloat16"),
            show_progress=False)
