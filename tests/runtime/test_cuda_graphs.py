"""CUDA graphs of one-row decode passes (runtime/cuda_graphs.py), their logic on the CPU: the padded, masked pass a
graph replays, its static buffers (the "capture" here returns the step itself), widths, the cache's reallocation,
a failed capture, when graphs apply. tests/runtime/test_gpu.py captures real graphs."""

from __future__ import annotations

import pytest
import torch

from moepager.config import ExpertFormat, SchedulerConfig
from moepager.runtime.cuda_graphs import DecodeGraphs, bucket, graphable
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams

PROMPTS = ["The history of", "Water boils at"]


def greedy(llm: LLM, tokens: int = 40) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    return [c.token_ids for p in PROMPTS for c in llm.generate([p], params)]  # one row at a time


def with_graphs(llm: LLM, capture=lambda step: step) -> DecodeGraphs:
    llm.engine.runner.graphs = DecodeGraphs(llm.loaded.model, llm.engine.pool, capture)
    return llm.engine.runner.graphs


def test_bucket_is_the_next_power_of_two_of_the_blocks_a_decode_spans():
    assert [bucket(n, 16) for n in (1, 16, 32, 33, 48, 49, 100, 1024, 1025)] == [2, 2, 2, 4, 4, 4, 8, 64, 128]


def test_replayed_passes_decode_the_eager_run_s_tokens_and_every_width_is_captured_once(demo_checkpoint):
    """The replayed pass reads a padded block table under a mask; the eager one its exact prefix: other rounding,
    the same greedy tokens here."""
    want = greedy(LLM(demo_checkpoint, show_progress=False))
    llm = LLM(demo_checkpoint, show_progress=False)
    captured: list[int] = []

    def capture(step):
        captured.append(1)
        return step
    graphs = with_graphs(llm, capture)
    assert greedy(llm) == want
    assert graphs.replays == 2 * 39  # every decode step of both requests
    assert llm.last_stats.graph_replays == 39 and "39 decode passes replayed" in llm.last_stats.table()
    assert sorted(graphs.graphs) == [2, 4] and len(captured) == 2  # prefixes up to 43 positions: widths 2 and 4
    ids_BT, batch = llm.engine.runner._last  # the last pass, as replayed: its padded, masked batch
    assert batch.block_table_BN is not None and batch.mask_B1TS is not None
    with torch.inference_mode():  # the same pass run eagerly (rewriting the same cache slot): equal bit for bit
        paged = (batch.block_table_BN, batch.slot_block_BT, batch.slot_offset_BT)
        replayed, _ = graphs.graphs[batch.block_table_BN.shape[1]].run(ids_BT, batch.positions_BT, paged)
        llm.loaded.experts.in_graph = True  # as in the graph: every layer's experts on the device (`indexed_rows`)
        eager = llm.loaded.model(ids_BT, batch, llm.engine.pool.cache, logits_at_B=torch.zeros(1, dtype=torch.long))
        llm.loaded.experts.in_graph = False
    assert torch.equal(replayed, eager)
    with_graphs(llm)  # a fresh set: warm captures every width the model's 2,048-position context can need
    llm.engine.runner.graphs.warm()
    assert sorted(llm.engine.runner.graphs.graphs) == [2 ** i for i in range(1, 8)]


@pytest.mark.parametrize("expert_dtype", ["int8", "int4"])
def test_quantized_experts_are_gathered_on_the_device_inside_a_graph_and_decode_the_eager_tokens(demo_checkpoint,
                                                                                                 monkeypatch,
                                                                                                 expert_dtype):
    """Quantized layers read their ids on the host eagerly (`loop`); inside a graph they gather their rows on the
    device (`indexed_rows`: int8 converted as copied, int4 in its CPU layout row by row, CUDA's plain nibbles
    dequantised at once), so a graph can capture them. fp32 rows (`loop` here, `_grouped_mm`'s fp32 path on CUDA)
    cannot be captured."""
    from moepager.config import EngineConfig
    from moepager.experts.executor import ArenaKernels

    config = EngineConfig(model=str(demo_checkpoint), experts=ExpertFormat(expert_dtype))
    want = greedy(LLM(show_progress=False, config=config), 16)
    llm = LLM(show_progress=False, config=config)
    assert llm.loaded.experts.graph_safe
    gathered = []
    indexed = ArenaKernels.indexed_rows
    monkeypatch.setattr(ArenaKernels, "indexed_rows", lambda self, *a: gathered.append(1) or indexed(self, *a))
    graphs = with_graphs(llm)
    assert greedy(llm, 16) == want
    assert graphs.replays == 2 * 15 and len(gathered) == 2 * 15 * llm.loaded.config.num_moe_layers
    assert not llm.loaded.experts.in_graph  # set only while a graph's pass runs
    assert not LLM(demo_checkpoint, show_progress=False).loaded.experts.graph_safe


def test_a_reallocated_cache_drops_the_graphs_that_held_its_addresses(demo_checkpoint):
    llm = LLM(demo_checkpoint, show_progress=False)
    graphs = with_graphs(llm)
    greedy(llm, 8)
    before = dict(graphs.graphs)
    llm.engine.pool.grow(llm.engine.pool.capacity_tokens * 2)
    greedy(llm, 8)
    assert graphs.graphs and all(graphs.graphs[w] is not before.get(w) for w in graphs.graphs)


def test_a_failed_capture_turns_graphs_off_and_decodes_eagerly(demo_checkpoint, capsys):
    want = greedy(LLM(demo_checkpoint, show_progress=False), 8)

    def refuse(step):
        raise RuntimeError("operation not permitted when stream is capturing")
    llm = LLM(demo_checkpoint, show_progress=False)
    graphs = with_graphs(llm, refuse)
    assert greedy(llm, 8) == want
    assert not graphs.enabled and graphs.replays == 0
    assert "CUDA graphs off" in capsys.readouterr().err


def test_an_observed_model_decodes_eagerly(demo_checkpoint, tmp_path):
    llm = LLM(demo_checkpoint, show_progress=False)
    graphs = with_graphs(llm)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=6, ignore_eos=True), record_trace=tmp_path / "t.mpt")
    assert graphs.replays == 0  # a trace recorder reads every routing decision on the host
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=6, ignore_eos=True))
    assert graphs.replays == 5


def test_graphs_need_cuda_and_resident_bf16_experts_computed_by_grouped_gemm(demo_checkpoint):
    llm = LLM(demo_checkpoint, show_progress=False)
    assert not graphable(llm.loaded.model, llm.loaded.experts, llm.loaded.device)
    assert llm.engine.runner.graphs is None


def test_warm_stops_at_the_cache_s_largest_width(demo_checkpoint):
    llm = LLM(show_progress=False, config=_config(demo_checkpoint, 64))
    graphs = with_graphs(llm)
    graphs.warm()
    assert sorted(graphs.graphs) == [2, 4]  # 64 positions: 4 blocks of 16


def test_warm_leaves_widths_past_its_cap_to_their_first_use(demo_checkpoint, monkeypatch):
    import moepager.runtime.cuda_graphs as cuda_graphs

    monkeypatch.setattr(cuda_graphs, "WARM_POSITIONS", 40)
    graphs = with_graphs(LLM(demo_checkpoint, show_progress=False))
    graphs.warm()
    assert sorted(graphs.graphs) == [2, 4]  # 40 positions: 3 blocks of 16


def _config(path, kv_tokens):
    from moepager.config import EngineConfig

    return EngineConfig(model=str(path), scheduler=SchedulerConfig(kv_cache_tokens=kv_tokens))
