"""The engine's KV cache: blocks from one pool, reused across calls, grown only when one request needs more."""

from __future__ import annotations

from moepager.config import EngineConfig, SchedulerConfig
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams


def test_calls_reuse_one_pool_and_give_a_fresh_engines_tokens(demo_checkpoint):
    llm = LLM(demo_checkpoint, show_progress=False)
    calls = [(["The history of the river"], 12), (["Water", "A long time ago in a kingdom by the sea"], 20),
             (["Hi"], 4), (["The history of the river"], 12)]
    for prompts, max_tokens in calls:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        got = [c.token_ids for c in llm.generate(prompts, params)]
        fresh = LLM(demo_checkpoint, show_progress=False).generate(prompts, params)
        assert got == [c.token_ids for c in fresh]  # stale blocks from earlier calls are never read
        assert len(llm.engine.pool.free) == llm.engine.pool.num_blocks - 1  # every block came back
    assert llm.engine.pool.allocations == 1


def test_a_request_larger_than_the_pool_grows_it_while_idle(demo_checkpoint):
    small = SchedulerConfig(kv_cache_tokens=32, block_size=8)
    llm = LLM(config=EngineConfig(model=str(demo_checkpoint), scheduler=small), show_progress=False)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    got = llm.generate("The history of the river", params)[0].token_ids
    assert llm.engine.pool.capacity_tokens >= len(llm.encode("The history of the river")) + 39
    assert got == LLM(demo_checkpoint, show_progress=False).generate("The history of the river", params)[0].token_ids
