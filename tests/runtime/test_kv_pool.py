"""The engine's one KV cache: reused across calls, grown when needed, and never leaking one call into the next."""

from __future__ import annotations

from moepager.runtime.generate import generate_ids
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from moepager.runtime.stats import RunStats


def test_calls_reuse_one_cache_and_give_the_fresh_cache_tokens(demo_checkpoint):
    llm = LLM(demo_checkpoint, show_progress=False)
    calls = [(["The history of the river"], 12), (["Water", "A long time ago in a kingdom by the sea"], 20),
             (["Hi"], 4), (["The history of the river"], 12)]
    for prompts, max_tokens in calls:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        got = [c.token_ids for c in llm.generate(prompts, params)]
        fresh = generate_ids(llm.loaded.model, [llm.encode(p) for p in prompts], params, [], RunStats())
        assert got == [s.out_ids for s in fresh]  # stale positions from earlier calls are never read
    assert llm.kv.allocations == 2  # the first call's size, then one growth for the batch of two
    assert llm.kv.rows == 2 and llm.kv.length >= max(len(llm.encode(p)) for p in calls[1][0]) + 20
