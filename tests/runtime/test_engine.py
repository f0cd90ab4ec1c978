"""The engine core: continuous batching gives every request the tokens it gets alone, whatever joins, chunks,
preempts or leaves beside it."""

from __future__ import annotations

import pytest

from moepager.config import EngineConfig, SchedulerConfig, StoreConfig
from moepager.runtime.engine import Engine
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from moepager.trace.format import TraceReader

PROMPTS = ["The history of computing", "Water", "In the morning the city was quiet and the river ran slow",
           "A long time ago in a kingdom by the sea there lived", "Hi"]
GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(demo_checkpoint):
    llm = LLM(demo_checkpoint, show_progress=False)
    return {p: llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS}


def engine_of(checkpoint, **scheduler) -> tuple[LLM, Engine]:
    llm = LLM(config=EngineConfig(model=str(checkpoint), scheduler=SchedulerConfig(**scheduler)), show_progress=False)
    return llm, llm.engine


def run_staggered(llm: LLM, engine: Engine, every: int = 3) -> dict[str, list[int]]:
    """Add one prompt every `every` steps while the others run; step until all finish."""
    pending, requests = list(PROMPTS), {}
    steps = 0
    while pending or engine.has_work():
        if pending and steps % every == 0:
            prompt = pending.pop(0)
            requests[prompt] = engine.new_request(llm.encode(prompt), GREEDY)
            engine.add(requests[prompt])
        engine.step()
        steps += 1
    return {p: r.out_ids for p, r in requests.items()}


def test_requests_joining_a_running_batch_get_their_tokens_alone(demo_checkpoint, alone):
    llm, engine = engine_of(demo_checkpoint)
    assert run_staggered(llm, engine) == alone
    assert len(engine.pool.free) == engine.pool.num_blocks - 1


def test_prompts_chunked_to_the_token_budget_beside_decodes(demo_checkpoint, alone):
    llm, engine = engine_of(demo_checkpoint, max_batched_tokens=4)
    seen_chunks = []
    on_pass = engine.runner.on_pass
    engine.runner.on_pass = lambda info: (seen_chunks.append(info.counts), on_pass(info))
    assert run_staggered(llm, engine, every=2) == alone
    assert all(sum(c) <= 4 for c in seen_chunks)
    assert any(len(c) > 1 for c in seen_chunks)  # requests shared passes


def test_running_out_of_kv_blocks_preempts_the_youngest_and_recomputes_it(demo_checkpoint, alone):
    llm, engine = engine_of(demo_checkpoint, kv_cache_tokens=48, block_size=4, max_num_seqs=5)
    assert run_staggered(llm, engine, every=1) == alone
    assert engine.scheduler.preemptions > 0


def test_the_request_limit_makes_the_rest_wait(demo_checkpoint, alone):
    llm, engine = engine_of(demo_checkpoint, max_num_seqs=2)
    largest = 0
    step = engine.step

    def counting_step():
        nonlocal largest
        largest = max(largest, len(engine.scheduler.running))
        return step()
    engine.step = counting_step  # type: ignore[method-assign]
    assert run_staggered(llm, engine, every=1) == alone
    assert largest == 2


def test_an_aborted_request_frees_its_blocks_and_the_others_go_on(demo_checkpoint, alone):
    llm, engine = engine_of(demo_checkpoint)
    keep = engine.new_request(llm.encode(PROMPTS[0]), GREEDY)
    drop = engine.new_request(llm.encode(PROMPTS[2]), GREEDY)
    engine.add(keep)
    engine.add(drop)
    for _ in range(3):
        engine.step()
    engine.abort(drop.request_id)
    outputs = engine.step()
    assert [o.finish_reason for o in outputs if o.request_id == drop.request_id] == ["abort"]
    list(engine.drain())
    assert keep.out_ids == alone[PROMPTS[0]] and drop.finish_reason == "abort"
    assert len(engine.pool.free) == engine.pool.num_blocks - 1


def test_a_request_over_the_kv_cache_is_refused_unless_the_caller_may_grow_it(demo_checkpoint):
    llm, engine = engine_of(demo_checkpoint, kv_cache_tokens=16)
    from moepager.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="KV cache holds 16"):
        engine.new_request(llm.encode(PROMPTS[0]), GREEDY)
    with pytest.raises(InvalidRequestError, match="context"):
        engine.new_request(llm.encode(PROMPTS[0]), SamplingParams(max_tokens=10**6))


def test_a_trace_recorded_under_preemption_equals_one_recorded_alone(demo_checkpoint, tmp_path):
    tight = EngineConfig(model=str(demo_checkpoint), store=StoreConfig(),
                         scheduler=SchedulerConfig(kv_cache_tokens=40, block_size=4))
    llm = LLM(config=tight, show_progress=False)
    llm.generate(PROMPTS[:4], GREEDY, record_trace=tmp_path / "batch.trace")
    assert llm.engine.scheduler.preemptions > 0
    single = LLM(demo_checkpoint, show_progress=False)
    for i, prompt in enumerate(PROMPTS[:4]):
        single.generate(prompt, GREEDY, record_trace=tmp_path / f"{i}.trace")
    with TraceReader(tmp_path / "batch.trace") as batch:
        for i, got in enumerate(batch):
            with TraceReader(tmp_path / f"{i}.trace") as one:
                want = next(iter(one))
            assert (got.ids_TLK == want.ids_TLK).all() and (got.phase_T == want.phase_T).all()
            assert (got.token_ids_T == want.token_ids_T).all()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "olmoe", "deepseek_v2", "deepseek_v3"])
def test_every_architecture_batches_chunks_and_preempts_without_changing_tokens(hf_checkpoint, arch):
    """Paged KV blocks under every attention kind (GQA, full-width q/k norm, MLA's latent cache)."""
    _, path = hf_checkpoint(arch)
    prompts = [[5, 9, 2, 7, 1, 3, 4, 8, 6, 11, 12], [7, 1], [3, 3, 9, 20, 4]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    single = LLM(path, show_progress=False)
    alone = [single.generate([p], params)[0].token_ids for p in prompts]
    tight = SchedulerConfig(max_batched_tokens=6, kv_cache_tokens=24, block_size=4)
    llm = LLM(config=EngineConfig(model=str(path), scheduler=tight), show_progress=False)
    assert [c.token_ids for c in llm.generate(prompts, params)] == alone
    assert llm.engine.scheduler.preemptions > 0


OTHERS = ["Water is", "In the morning", "A long time ago", "The city", "Science", "My friend", "On the river"]


@pytest.mark.parametrize("company", [1, 3, 7])
def test_batch_invariant_a_request_gets_its_tokens_alone_among_any_company(company):
    """The built-in model in bf16 (where a batched row's kernels round differently from a lone row's): with
    `batch_invariant` the same greedy request gives the same tokens alone and among 1, 3 or 7 others, whichever step
    it joins at."""
    llm = LLM(config=EngineConfig(scheduler=SchedulerConfig(batch_invariant=True, max_batched_tokens=24)),
              show_progress=False)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    target = "The history of the island"
    alone = llm.generate(target, params)[0].token_ids
    engine = llm.engine
    for join_at in range(0, 6, 2):
        others = [engine.new_request(llm.encode(p), params) for p in OTHERS[:company]]
        for r in others:
            engine.add(r)
        steps, request = 0, None
        while request is None or engine.has_work():
            if request is None and steps == join_at:
                request = engine.new_request(llm.encode(target), params)
                engine.add(request)
            engine.step()
            steps += 1
        assert request.out_ids == alone, (company, join_at)
