"""The shadow's alignment (runtime/shadow.py), in one process: it runs ahead on its own guesses, a right guess costs
nothing more when the main rank's token comes, a wrong one is computed again from where it differs, and the cache it
ends with is the one a shadow that never ran ahead has (the same next-token guess, bit for bit)."""

from __future__ import annotations

import torch

from moepager.config import EngineConfig, RemoteConfig
from moepager.experts.remote.kv_align import KVAligner, gather, slots
from moepager.experts.remote.placement import Placement
from moepager.runtime import shadow as shadow_module
from moepager.runtime.builder import build
from moepager.runtime.kv_pool import KVBlockPool
from moepager.runtime.runner import ModelRunner
from moepager.runtime.scheduler import Scheduled
from moepager.runtime.shadow import Shadow, ShadowRequest
from moepager.types import PassInfo

PROMPT = [3, 11, 5, 7, 2]
LONG = [(7 * i + 3) % 96 for i in range(24)]


def make(path, align: int, forecasts: list[int], monkeypatch) -> Shadow:
    monkeypatch.setattr(shadow_module, "send_forecasts", lambda *args: forecasts.append(args[2]))  # its pass_id
    config = EngineConfig(model=str(path), threads=1, remote=RemoteConfig(workers=2, shadow=True, align_period=align))
    return Shadow(config, path, Placement((2, 3), 2))


def tell(shadow: Shadow, pass_id: int, start: int, tokens: list[int], decoding: bool) -> None:
    """What `serve` does with one announced pass of request 0."""
    shadow.pass_id = shadow.told = pass_id
    told = shadow._run([[0, start, len(tokens), int(decoding)]], tokens)
    for step in range(1, shadow.ahead + 1):
        shadow._run_ahead(told, pass_id + step)


def test_the_shadow_runs_ahead_then_realigns_with_the_main_ranks_tokens(hf_checkpoint, monkeypatch):
    path = hf_checkpoint("qwen3_moe")[1]
    ahead_passes: list[int] = []
    ahead = make(path, 3, ahead_passes, monkeypatch)
    tell(ahead, 1, 0, PROMPT, False)  # the prompt: nothing guessed yet
    first = ahead.requests[0].guess
    assert first is not None and ahead.passes_ahead == 0
    tell(ahead, 2, 5, [first], True)  # a decode pass: two passes guessed after it
    request = ahead.requests[0]
    assert len(request.ids) == 8 and request.told == 6 and ahead.passes_ahead == 2
    assert max(ahead_passes) == 4  # forecasts for passes 3 and 4, before the main rank announces them
    guess3, guess4 = request.ids[6], request.ids[7]
    computed = request.num_computed
    tell(ahead, 3, 6, [guess3], True)  # right: nothing computed again, one more pass guessed
    assert (ahead.guessed, ahead.right) == (1, 1) and request.num_computed == computed + 1
    wrong = (guess4 + 1) % 96
    tell(ahead, 4, 7, [wrong], True)  # wrong: computed again from position 7, then guessed ahead again
    assert request.ids[7] == wrong and (ahead.guessed, ahead.right) == (2, 1)
    assert len(request.ids) == 10 and request.told == 8

    aligned_passes: list[int] = []
    aligned = make(path, 1, aligned_passes, monkeypatch)  # never ahead: told the same tokens
    for pass_id, start, tokens, decoding in ((1, 0, PROMPT, False), (2, 5, [first], True), (3, 6, [guess3], True),
                                             (4, 7, [wrong], True)):
        tell(aligned, pass_id, start, tokens, decoding)
    assert aligned.passes_ahead == 0 and max(aligned_passes) == 4
    assert aligned.requests[0].guess == request.ids[8]  # the same cache gives the same next token
    assert torch.equal(torch.tensor(aligned.requests[0].ids[:8]), torch.tensor(request.ids[:8]))


def main_rank(path):
    """The main rank's full-precision model with a KV pool and a runner of its own, like the shadow's."""
    loaded = build(EngineConfig(model=str(path), threads=1), path, False).loaded
    pool = KVBlockPool(loaded.model, loaded.dtype, loaded.device, 64, 4)
    return ModelRunner(loaded.model, pool, loaded.device), pool


def decode_logits(runner: ModelRunner, request: ShadowRequest, token: int) -> torch.Tensor:
    """One decode pass of `token` after what the request's cache holds."""
    request.ids.append(token)
    assert runner.pool.reserve(request.blocks, len(request.ids))
    ((_, logits),) = runner.run([Scheduled(request, len(request.ids) - 1, 1, True)])
    request.num_computed = len(request.ids)
    return logits.float()


def test_kv_alignment_gives_the_shadow_the_main_ranks_entries_and_its_next_pass_comes_closer(hf_checkpoint,
                                                                                            monkeypatch):
    """The main rank computes the prompt at full precision; at the next pass its feed sends the prompt's entries
    (KVAligner, late departure), the shadow writes them over its int8-computed ones (exactly, every layer, at its own
    blocks) and its decode pass's logits are then nearer the main rank's than an unaligned shadow's."""
    path = hf_checkpoint("qwen3_moe")[1]
    runner, pool = main_rank(path)
    ours = ShadowRequest(0, list(LONG))
    assert pool.reserve(ours.blocks, len(LONG))
    ((_, logits),) = runner.run([Scheduled(ours, 0, len(LONG), False)])
    ours.num_computed = len(LONG)
    first = int(logits.argmax())
    aligner = KVAligner(1)
    prompt_pass = PassInfo(0, "prefill", (0,), (0,), (len(LONG),), ("prefill",), torch.tensor(LONG),
                           (ours.blocks,))
    assert aligner.payload(prompt_pass, pool) is None
    decode_pass = PassInfo(1, "decode", (0,), (len(LONG),), (1,), ("decode",), torch.tensor([first]), (ours.blocks,))
    spans, entries = aligner.payload(decode_pass, pool)
    assert spans.tolist() == [[0, 0, len(LONG)]]

    aligned, drifting = make(path, 1, [], monkeypatch), make(path, 1, [], monkeypatch)
    for shadow in (aligned, drifting):
        tell(shadow, 0, 0, LONG, False)
    theirs = aligned.requests[0]
    at_main, at_shadow = (slots(r.blocks, 0, len(LONG), 4 if r is ours else aligned.pool.block_size)
                          for r in (ours, theirs))
    assert not torch.equal(gather(aligned.pool.cache, at_shadow), gather(pool.cache, at_main))  # int8's drift
    aligned.align(spans.tolist(), entries)
    assert aligned.aligned == len(LONG)
    assert torch.equal(gather(aligned.pool.cache, at_shadow), gather(pool.cache, at_main).to(aligned.pool.dtype))

    reference = decode_logits(runner, ours, first)
    near, far = (decode_logits(s.runner, s.requests[0], first) for s in (aligned, drifting))
    assert (near - reference).norm() < (far - reference).norm()  # 0.0058 against 0.0066 (logits of norm 1.1)
