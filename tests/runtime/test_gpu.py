"""CUDA path: the same model on the GPU gives the CPU's greedy tokens and reports peak CUDA memory.

Runs only with `python -m pytest -m gpu` on a machine with CUDA.
"""

from __future__ import annotations

import pytest
import torch

from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_generation_matches_cpu(demo_checkpoint):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    cpu = LLM(demo_checkpoint, show_progress=False).generate(["The history of", "Water"], params)
    gpu_llm = LLM(demo_checkpoint, device="cuda", show_progress=False)
    gpu = gpu_llm.generate(["The history of", "Water"], params)
    # fp32 on both devices: kernels differ, so allow rare argmax flips late in the sequence.
    for a, b in zip(cpu, gpu):
        assert a.token_ids[:8] == b.token_ids[:8]
    assert gpu_llm.last_stats.peak_cuda_bytes and gpu_llm.last_stats.peak_cuda_bytes > 0
    assert next(gpu_llm.loaded.model.parameters()).device.type == "cuda"


def syncs_per_decode_token(llm: LLM) -> float:
    """Host<->device synchronizations per decode step, counted with torch's sync debug mode (every
    synchronizing CUDA call warns): the difference of a 17- and a 1-token generation over 16 steps."""
    import warnings

    def syncs(max_tokens: int) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                llm.generate("The history of", SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)
    syncs(2)
    return (syncs(17) - syncs(1)) / 16


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """The tiny geometry in bf16: the format `_grouped_mm` computes without reading anything on the host (its fp32
    path reads the group offsets there: two syncs per MoE layer, seen on an H200), so CUDA graphs apply."""
    from moepager.loading.synth import make_model

    return make_model(tmp_path_factory.mktemp("tiny_bf16"), "tiny", "qwen3_moe", dtype="bfloat16",
                      show_progress=False)


def test_cuda_graphs_replay_the_padded_pass_and_paging_matches_the_eager_step(bf16_checkpoint):
    """A replayed graph computes its padded, masked pass bit for bit; the eager step (`--no-cuda-graphs`) reads the
    exact prefix, so it rounds otherwise (the same first tokens), and a paged run gives the eager step's tokens."""
    from moepager.config import EngineConfig, StoreConfig

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = ["The history of", "Water", "A"]
    graphed = LLM(bf16_checkpoint, device="cuda", show_progress=False)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.enabled and len(graphs.graphs) == 7  # warm: the 2,048-position context
    got = [graphed.generate([p], params)[0].token_ids for p in prompts]  # one row: every decode step replayed
    assert graphs.enabled and graphs.replays == 3 * 39 + 1  # and the prefill of "A", one token: a decode's shape
    ids_BT, batch = graphed.engine.runner._last
    with torch.inference_mode():
        paged = (batch.block_table_BN, batch.slot_block_BT, batch.slot_offset_BT)
        replayed, _ = graphs.graphs[batch.block_table_BN.shape[1]].run(ids_BT, batch.positions_BT, paged)
        eager_pass = graphed.loaded.model(ids_BT, batch, graphed.engine.pool.cache,
                                          logits_at_B=torch.zeros(1, dtype=torch.long, device="cuda"))
    assert torch.equal(replayed, eager_pass)
    eager = LLM(show_progress=False, config=EngineConfig(model=str(bf16_checkpoint), device="cuda", cuda_graphs=False))
    assert eager.engine.runner.graphs is None
    want = [eager.generate([p], params)[0].token_ids for p in prompts]
    assert [t[:8] for t in got] == [t[:8] for t in want]
    paged = LLM(bf16_checkpoint, device="cuda", show_progress=False, store=StoreConfig(expert_memory="50%"))
    assert paged.engine.runner.graphs is None
    assert [paged.generate([p], params)[0].token_ids for p in prompts] == want


@pytest.mark.parametrize("expert_dtype", ["int8", "int4"])
def test_quantized_experts_replay_a_cuda_graph_and_decode_the_eager_step_s_first_tokens(bf16_checkpoint,
                                                                                        expert_dtype):
    """Quantized layers gather their rows on the device inside a graph (`indexed_rows`; int4 as plain nibbles,
    dequantised at once), so int8 and int4 runs are graphed too."""
    from moepager.config import EngineConfig, ExpertFormat

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    graphed = LLM(show_progress=False, config=EngineConfig(model=str(bf16_checkpoint), device="cuda",
                                                          experts=ExpertFormat(dtype=expert_dtype)))
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.enabled
    got = graphed.generate(["The history of"], params)[0].token_ids
    assert graphs.replays == 23 and graphed.last_stats.graph_replays == 23
    eager = LLM(show_progress=False, config=EngineConfig(model=str(bf16_checkpoint), device="cuda",
                                                        experts=ExpertFormat(dtype=expert_dtype),
                                                        cuda_graphs=False))
    assert eager.generate(["The history of"], params)[0].token_ids[:8] == got[:8]


def test_host_syncs_per_decode_token(bf16_checkpoint):
    """Issue 15: at most one sync per decode token all resident (sampling), graphed or not, one more per MoE layer
    paged (the store must know which experts a layer routed to)."""
    from moepager.config import EngineConfig, StoreConfig

    resident = LLM(bf16_checkpoint, device="cuda", show_progress=False)
    assert syncs_per_decode_token(resident) <= 1 and resident.engine.runner.graphs.replays > 0
    eager = LLM(show_progress=False, config=EngineConfig(model=str(bf16_checkpoint), device="cuda", cuda_graphs=False))
    assert syncs_per_decode_token(eager) <= 1
    paged = LLM(bf16_checkpoint, device="cuda", show_progress=False, store=StoreConfig(expert_memory="50%"))
    assert syncs_per_decode_token(paged) <= 1 + paged.loaded.config.num_moe_layers


@pytest.mark.parametrize("predictor", ["gate-lookahead", "expert-map"])
def test_host_syncs_per_decode_token_with_a_predictor(bf16_checkpoint, predictor):
    """Issue 15's 1 + L with a predictor: a predicted layer copies its routed ids to the host with what the predictor
    reads (gate-lookahead's forecast, computed on the device first; expert-map's router scores) in one wait
    (models/routing.py); expert-map's prompt-semantic embedding, which its first forecasts match on before any layer
    runs, is looked up in a host copy of the embedding table (runtime/prefetch.py `_embedding`): no wait for it."""
    from moepager.config import PrefetchConfig, StoreConfig

    llm = LLM(bf16_checkpoint, device="cuda", show_progress=False, store=StoreConfig(expert_memory="50%"),
              prefetch=PrefetchConfig(predictor, learn=predictor == "expert-map"))
    assert syncs_per_decode_token(llm) <= 1 + llm.loaded.config.num_moe_layers


def test_the_semantic_embedding_of_a_cuda_model_needs_no_sync():
    """expert-map's prompt embedding on a CUDA model: looked up in the host copy of the table, no sync."""
    import warnings

    from moepager.runtime.prefetch import _embedding

    table = torch.nn.Embedding(50, 8, device="cuda")
    embed = _embedding(table)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            got = embed(torch.tensor([3, 7]))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not any("synchroniz" in str(w.message) for w in caught)
    assert got.device.type == "cpu" and torch.equal(got, table.weight.detach()[[3, 7]].cpu())

def test_to_host_copies_several_tensors_with_one_sync():
    """types.to_host: pinned, non-blocking copies of every CUDA tensor and one stream synchronization after them
    (the observed MoE layer's one wait); host tensors pass through as they are."""
    import warnings

    from moepager.types import to_host

    ids = torch.arange(12, device="cuda").reshape(3, 4)
    scores = torch.rand(3, 8, device="cuda").t()  # not contiguous
    host = torch.ones(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            got = to_host(ids, scores, host)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sum("synchroniz" in str(w.message) for w in caught) == 1
    assert torch.equal(got[0], ids.cpu()) and torch.equal(got[1], scores.cpu()) and got[2] is host
    assert got[0].is_pinned() and got[1].is_pinned()
