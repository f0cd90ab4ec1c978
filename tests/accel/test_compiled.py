"""The compiled one-token decode step (`--compile`): the eager step's logits and greedy tokens, the graph run whole
(no eager MoE call while decoding), the eager step wherever routing is recorded or replayed, and a clear error
wherever it cannot apply. Each compile takes tens of seconds on 2 cores: one architecture in the default suite,
the others marked slow."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moepager.accel import compiled, cpu_kernels, packed
from moepager.accel.compiled import check_compilable, compile_decode
from moepager.accel.dense_quant import Int8A8Linear
from moepager.accel.packed import FusedLinear, PackedLinear, packing_available
from moepager.config import EngineConfig, ExpertFormat, PrefetchConfig, StoreConfig
from moepager.errors import ConfigError
from moepager.experts.executor import ResidentExecutor
from moepager.experts.quant import int8_packing_available
from moepager.experts.weights import ExpertShape
from moepager.models import graph_exit
from moepager.placements.paged import paged_executor
from moepager.runtime.builder import load_model
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from moepager.trace.format import TraceReader
from tests.conftest import ARCHS, expert_budget
from tests.runtime.test_offload import logits_run

SLOW = pytest.mark.slow
"""A TorchInductor compile, tens of seconds on 2 cores: the default suite keeps one resident and one paged compile
(the eager logits, bit-exact paging); the rest run with -m slow."""

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


@SLOW
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


@SLOW
@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")
def test_a_large_bf16_lm_head_runs_prepacked_after_the_graph(hf_checkpoint, monkeypatch, onednn):
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


@SLOW
@pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")
def test_prepacked_dense_projections_leave_the_graph_and_keep_their_kernel(hf_checkpoint, monkeypatch, onednn):
    """Projections `pack_dense` prepacked (here: all of them) stay prepacked under `--compile`: the graph calls each
    through the `packed_linear` exit, the eager prepacked run's logits to bf16 rounding."""
    monkeypatch.setattr(packed, "PACK_MIN_ELEMENTS", 0)
    _, path = hf_checkpoint("qwen3_moe")
    ref = logits_run(load_model(path, torch.bfloat16, show_progress=False), steps=3, rows=1)
    loaded = load_model(path, torch.bfloat16, show_progress=False)
    compile_decode(loaded.model, loaded.experts, loaded.expert_shape, loaded.device)
    exits = [m.graph_exit for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert len(exits) > 2 and None not in exits  # attention's fused qkv and o of each layer, and the head
    for a, b in zip(logits_run(loaded, steps=3, rows=1), ref):
        assert (a.float() - b.float()).norm() < 0.02 * b.float().norm()


@SLOW
@pytest.mark.skipif(not cpu_kernels.available(), reason="no moepager CPU kernels here")
def test_under_compile_only_the_head_keeps_moepagers_gemv(hf_checkpoint):
    """With moepager's CPU kernels, loading puts every bf16 projection on its GEMV; `--compile` gives them back to the
    graph as plain projections (each would otherwise be a graph exit) but the LM head, which runs after the graph;
    the compiled step gives the eager run's logits to bf16 rounding."""
    _, path = hf_checkpoint("qwen3_moe")
    ref = logits_run(load_model(path, torch.bfloat16, show_progress=False), steps=3, rows=1)
    loaded = load_model(path, torch.bfloat16, show_progress=False)
    assert sum(isinstance(m, FusedLinear) for m in loaded.model.modules()) > 2
    compile_decode(loaded.model, loaded.experts, loaded.expert_shape, loaded.device)
    assert [m for m in loaded.model.modules() if isinstance(m, FusedLinear)] == [loaded.model.lm_head]
    for a, b in zip(logits_run(loaded, steps=3, rows=1), ref):
        assert (a.float() - b.float()).norm() < 0.02 * b.float().norm()


@SLOW
@pytest.mark.skipif(not int8_packing_available(), reason="this torch build has no FBGEMM")
def test_fbgemm_dense_projections_leave_the_compiled_graph(demo_checkpoint):
    """`--dense-dtype int8-a8`'s projections hold FBGEMM-packed weights: the graph calls each through the
    `opaque_linear` exit, with the eager int8-a8 run's greedy tokens."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    config = EngineConfig(model=str(demo_checkpoint), dense_dtype="int8-a8")
    want = LLM(config=config, show_progress=False).generate("a b c", params)[0].token_ids
    llm = LLM(config=replace(config, compile=True), show_progress=False)
    exits = [m.graph_exit for m in llm.loaded.model.modules() if isinstance(m, Int8A8Linear)]
    assert exits and None not in exits
    assert llm.generate("a b c", params)[0].token_ids == want


@SLOW
def test_int8_experts_decode_through_the_compiled_graph(demo_checkpoint, monkeypatch):
    """int8 experts are copied out of the arena and converted inside the graph (ArenaKernels._gathered_swiglu):
    the eager int8 run's greedy tokens, and no eager MoE call while decoding."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    config = EngineConfig(model=str(demo_checkpoint), experts=ExpertFormat("int8"))
    want = LLM(config=config, show_progress=False).generate("a b c", params)[0].token_ids
    llm = LLM(config=replace(config, compile=True), show_progress=False)
    calls = []
    run = ResidentExecutor.run
    monkeypatch.setattr(ResidentExecutor, "run", lambda self, *a: calls.append(a[0]) or run(self, *a))
    assert llm.generate("a b c", params)[0].token_ids == want
    assert len(calls) == len(llm.loaded.config.moe_layers)  # the prefill only


def test_a_paged_compiled_step_gives_the_resident_compiled_logits_bit_for_bit(hf_checkpoint, monkeypatch):
    """Offloading under `--compile` changes nothing: the paged step leaves its graph at each MoE layer for the store
    and the executor's eager kernels, exactly as a resident step whose experts are too large for the graph does, and
    the two give the same logits bit for bit (and the eager step's, to fp32 rounding)."""
    _, path = hf_checkpoint("qwen3_moe")
    ref = logits_run(load_model(path, show_progress=False), steps=5, rows=1)
    monkeypatch.setattr(compiled, "COMPILE_MAX_EXPERT_BYTES", 0)  # resident experts leave the graph too
    resident = load_model(path, show_progress=False)
    assert not compiled.experts_in_graph(resident.experts, resident.expert_shape)
    compile_decode(resident.model, resident.experts, resident.expert_shape, resident.device)
    want = logits_run(resident, steps=5, rows=1)
    config = StoreConfig(expert_memory=expert_budget(resident.expert_shape.nbytes, resident.config.top_k))
    paged = load_model(path, executor_factory=paged_executor(config, CPU), show_progress=False)
    compile_decode(paged.model, paged.experts, paged.expert_shape, paged.device)
    assert all(b.graph_exit is not None for b in paged.model.moe_blocks())
    got = logits_run(paged, steps=5, rows=1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert sum(p.loads_on_demand for p in paged.experts.store.counters.phases.values()) > 0  # it really paged
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    paged.experts.store.close()


class CountingStep:
    """Stands in a graph-exit handle's block (models/graph_exit.py) and counts the host steps it runs."""

    def __init__(self, block, seen: list[int]):
        self.block, self.seen = block, seen

    def host_step(self, x_ND, route):  # noqa: ANN001, ANN201 - the HostStep protocol's
        self.seen.append(self.block.layer)
        return self.block.host_step(x_ND, route)


@SLOW
def test_the_engine_pages_and_prefetches_through_the_compiled_graph(demo_checkpoint):
    """At a quarter of the experts, with gate-lookahead prefetch, every decode step runs the compiled graph and leaves
    it once per MoE layer (where the predictor observes the routing and the store pages): the eager paged run's
    greedy tokens, with prefetches issued."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    budget = expert_budget(load_model(demo_checkpoint, show_progress=False).expert_shape.nbytes, 12)
    config = EngineConfig(model=str(demo_checkpoint), store=StoreConfig(expert_memory=budget),
                          prefetch=PrefetchConfig("gate-lookahead"))
    want = LLM(config=config, show_progress=False).generate("a b c", params)[0].token_ids
    llm = LLM(config=replace(config, compile=True), show_progress=False)
    seen: list[int] = []
    blocks = llm.loaded.model.moe_blocks()
    steps = [CountingStep(b, seen) for b in blocks]
    for block, step in zip(blocks, steps):
        graph_exit._BLOCKS[block.graph_exit] = step
    try:
        assert llm.generate("a b c", params)[0].token_ids == want
    finally:
        for block in blocks:
            graph_exit._BLOCKS[block.graph_exit] = block
    assert seen == [b.layer for b in blocks] * 11  # the 11 decode steps, each layer once: none ran eagerly
    decode = llm.store.counters.phases["decode"]
    assert decode.loads_ahead > 0 and decode.loads_on_demand > 0


@SLOW
@pytest.mark.parametrize("paged", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["resident", "paged"])
def test_concurrent_requests_decode_through_the_compiled_graph(demo_checkpoint, monkeypatch, paged):
    """Decode passes of several rows (requests at different lengths) run the compiled graph too, once
    `warm_batched_decode` has compiled its batched graphs: no further compile for another row count, only the
    prefill runs eagerly, and the eager batched run's greedy tokens; paged, each layer leaves through the exit."""
    from torch._dynamo.utils import counters

    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = ["a b c", "the history of the", "x", "one two three four five"]
    store = StoreConfig()
    if paged:
        nbytes = load_model(demo_checkpoint, show_progress=False).expert_shape.nbytes
        store = StoreConfig(expert_memory=expert_budget(nbytes, 12))
    config = EngineConfig(model=str(demo_checkpoint), store=store)
    want = [c.token_ids for c in LLM(config=config, show_progress=False).generate(prompts, params)]
    llm = LLM(config=replace(config, compile=True), show_progress=False)
    model = llm.loaded.model
    assert model.compiled_rows
    llm.warm_batched_decode()
    graphs = counters["stats"]["unique_graphs"]
    passes, calls, exits = [], [], []  # patched around the model, not on it: its attributes are guarded
    runner = llm.engine.runner
    on_pass = runner.on_pass
    monkeypatch.setattr(runner, "on_pass", lambda info: passes.append(info) or on_pass(info))
    executor = type(model.moe_blocks()[0].executor)
    run = executor.run
    monkeypatch.setattr(executor, "run", lambda self, *a: calls.append(a[0]) or run(self, *a))
    blocks = model.moe_blocks() if paged else []
    steps = [CountingStep(b, exits) for b in blocks]  # held here: the handle registry holds them weakly
    for block, step in zip(blocks, steps):
        graph_exit._BLOCKS[block.graph_exit] = step
    try:
        got = [c.token_ids for c in llm.generate(prompts, params)]
    finally:
        for block in blocks:
            graph_exit._BLOCKS[block.graph_exit] = block
    assert got == want
    assert counters["stats"]["unique_graphs"] == graphs  # the warm-up's graphs serve 4 rows: nothing compiled
    layers = len(blocks or model.moe_blocks())
    prefills = [p for p in passes if p.phase == "prefill"]  # "x" is one token: its prompt may pass alone
    assert [p.counts for p in passes if p.phase == "decode"] == [(1, 1, 1, 1)] * 9  # 9 decode passes of the 4 rows
    assert len(exits) == 9 * len(blocks)  # paged: each decode pass left the graph at every MoE layer
    assert len(calls) == len(prefills) * layers + len(exits)  # and only the prefill ran the eager model


@SLOW
def test_warming_batched_decode_runs_nothing_where_nothing_compiles_batched(demo_checkpoint, monkeypatch):
    """`warm_batched_decode` generates only where batched decode passes compile: not without --compile, and not
    with one row at a time (--max-num-seqs 1)."""
    from moepager.config import SchedulerConfig

    eager = LLM(config=EngineConfig(model=str(demo_checkpoint)), show_progress=False)
    one_row = LLM(config=EngineConfig(model=str(demo_checkpoint), compile=True,
                                      scheduler=SchedulerConfig(max_num_seqs=1)), show_progress=False)
    for llm in (eager, one_row):
        monkeypatch.setattr(llm, "generate", lambda *a, **k: pytest.fail("nothing should be generated"))
        llm.warm_batched_decode()


@SLOW
@pytest.mark.parametrize("in_graph", [True, False], ids=["in-graph", "graph-exit"])
def test_int4_experts_decode_through_the_compiled_step(demo_checkpoint, monkeypatch, in_graph):
    """int4 experts are copied packed out of the arena into torch's int4 GEMV inside the graph (unrolled per routed
    expert), or, over COMPILE_MAX_EXPERT_BYTES, leave it at each MoE layer for the eager int4 kernels: either way the
    eager int4 run's greedy tokens."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    config = EngineConfig(model=str(demo_checkpoint), experts=ExpertFormat("int4"))
    want = LLM(config=config, show_progress=False).generate("a b c", params)[0].token_ids
    if not in_graph:
        monkeypatch.setattr(compiled, "COMPILE_MAX_EXPERT_BYTES", 0)
    llm = LLM(config=replace(config, compile=True), show_progress=False)
    assert all((b.graph_exit is None) == in_graph for b in llm.loaded.model.moe_blocks())
    assert llm.loaded.model.compiled_rows is not in_graph  # unrolled per routed expert: batched passes stay eager
    calls = []
    run = ResidentExecutor.run
    monkeypatch.setattr(ResidentExecutor, "run", lambda self, *a: calls.append(a[0]) or run(self, *a))
    assert llm.generate("a b c", params)[0].token_ids == want
    layers = len(llm.loaded.config.moe_layers)
    assert len(calls) == (1 if in_graph else 12) * layers  # in the graph: the prefill's eager layers only


def test_compile_refuses_what_it_cannot_run(monkeypatch):
    with pytest.raises(ConfigError, match="runs on the CPU"):
        check_compilable(torch.device("cuda"))

    def no_compiler():
        raise RuntimeError("no working C++ compiler found")
    monkeypatch.setattr("torch._inductor.cpp_builder.get_cpp_compiler", no_compiler)
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler.*install g\\+\\+"):
        check_compilable(CPU)


@SLOW
def test_experts_the_graph_cannot_copy_leave_it(demo_checkpoint, monkeypatch):
    """Only resident float, int8 or int4 experts of at most COMPILE_MAX_EXPERT_BYTES are computed inside the graph;
    prepacked, paged or larger ones run eagerly through the graph exit."""
    shape = ExpertShape(256, 64, torch.bfloat16)
    resident = ResidentExecutor(torch.zeros(2, shape.numel, dtype=torch.bfloat16), shape, [0], 2)
    assert compiled.experts_in_graph(resident, shape)
    monkeypatch.setattr(compiled, "COMPILE_MAX_EXPERT_BYTES", shape.nbytes - 1)
    assert not compiled.experts_in_graph(resident, shape)
    monkeypatch.undo()
    loaded = load_model(demo_checkpoint, show_progress=False, expert_dtype="int4")
    assert compiled.experts_in_graph(loaded.experts, loaded.expert_shape)
