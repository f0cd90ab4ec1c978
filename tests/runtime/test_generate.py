"""Generation behaviour on a make-model checkpoint (tokenizer included)."""

from __future__ import annotations

import json

import pytest

from moepager.errors import InvalidRequestError
from moepager.runtime.engine import Engine
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from moepager.runtime.stats import percentile


@pytest.fixture(scope="module")
def llm(demo_checkpoint):
    return LLM(demo_checkpoint, show_progress=False)


def test_batched_prompts_equal_single_runs(llm):
    prompts = ["The history of computing", "Water", "In the morning the city was quiet and"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    batch = llm.generate(prompts, params)
    for prompt, got in zip(prompts, batch):
        assert llm.generate(prompt, params)[0].token_ids == got.token_ids


def test_sampling_batch_matches_single_runs_with_per_request_seed(llm):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=20, top_p=0.9, seed=3, ignore_eos=True)
    batch = llm.generate(["a b c", "hello"], params)
    assert llm.generate(["a b c"], params)[0].token_ids == batch[0].token_ids
    assert llm.generate(["a b c", "hello"], params)[1].token_ids == batch[1].token_ids


def test_streamed_text_concatenates_to_the_final_text(llm):
    pieces: dict[int, list[str]] = {0: [], 1: []}
    out = llm.generate(["The", "Science"], SamplingParams(max_tokens=20, ignore_eos=True),
                       on_text=lambda i, t: pieces[i].append(t))
    for i in (0, 1):
        assert "".join(pieces[i]) == out[i].text == llm.tokenizer.decode(out[i].token_ids)


def test_stop_string_truncates_and_finishes(llm):
    free = llm.generate("The", SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop = free.text[5:8]
    assert stop and len(free.text) > 8
    out = llm.generate("The", SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.find(stop)]
    assert stop not in out.text


def test_eos_stops_generation(llm):
    free = llm.generate("The", SamplingParams(max_tokens=8, ignore_eos=True))[0]
    eos = free.token_ids[3]
    engine = Engine(llm.loaded.model, llm.loaded.dtype, llm.loaded.device, llm.config.scheduler, [eos], None)
    request = engine.new_request(llm.encode("The"), SamplingParams(max_tokens=8))
    engine.add(request)
    list(engine.drain())
    assert request.out_ids == free.token_ids[:3] and request.finish_reason == "stop"


def test_max_tokens_and_statistics(llm, tmp_path):
    out = llm.generate(["one", "two"], SamplingParams(max_tokens=5, ignore_eos=True))
    assert [len(c.token_ids) for c in out] == [5, 5] and all(c.finish_reason == "length" for c in out)
    s = llm.last_stats
    assert s.num_prompts == 2 and s.generated_tokens == 10 and len(s.tpot_s) == 4
    assert 0 < s.ttft_s and s.tpot_p90_s >= s.tpot_median_s > 0 and s.peak_rss_bytes > 0
    s.write_json(tmp_path / "s.json")
    data = json.loads((tmp_path / "s.json").read_text())
    assert {"ttft_s", "tpot_median_s", "tpot_p90_s", "decode_tokens_per_s", "peak_rss_bytes"} <= data.keys()
    assert "TPOT p90" in s.table()


def test_percentile():
    assert percentile([], 50) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0, 1.0, 3.0], 90) == pytest.approx(4.6)


def test_prompt_longer_than_context_is_rejected(llm):
    context = llm.loaded.config.max_position_embeddings
    with pytest.raises(InvalidRequestError, match="exceeds the model's context"):
        llm.generate([[1] * context], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        llm.generate([[llm.loaded.config.vocab_size]])


def test_chat_template_matches_transformers(llm, demo_checkpoint):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(demo_checkpoint)
    messages = [{"role": "user", "content": "Hello there"}]
    ref = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert llm.tokenizer.apply_chat_template(messages) == ref
    assert llm.encode("Hello there", chat=True) == tok(ref, add_special_tokens=False)["input_ids"]


def test_a_closed_and_dropped_engine_frees_its_model(demo_checkpoint):
    # the engine freezes its model's objects out of the cyclic collector (gc.freeze); closing hands them back, so
    # the memory of an engine a program drops is freed, not kept until the process ends
    import gc
    import weakref

    with LLM(demo_checkpoint, show_progress=False) as engine:
        engine.generate("The", SamplingParams(max_tokens=2, ignore_eos=True))
        model, whole = weakref.ref(engine.loaded.model), weakref.ref(engine)
    del engine
    gc.collect()
    assert whole() is None and model() is None
