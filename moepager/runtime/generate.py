"""The generation loop: batched prefill, then one decode step per token for every unfinished prompt.

Prompts of a static batch are right-padded for prefill (padding sits after every real token, so causal
attention never sees it, and the MoE blocks skip it). Each row then decodes at its own position; rows that
finish leave the batch (their cache rows stay, unused), so no expert is loaded for a finished prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from moepager.models.layers import CausalLM, ForwardBatch
from moepager.errors import NumericalError
from moepager.runtime.kv_pool import KVCachePool
from moepager.runtime.sampling import NonFiniteLogits, Sampler, SamplingParams
from moepager.runtime.stats import RunStats
from moepager.types import Phase

FinishReason = Literal["stop", "length"]
Detokenize = Callable[[Sequence[int]], str]
OnText = Callable[[int, str], None]
"""Called with (prompt index, newly final text) as generation proceeds."""
OnPhase = Callable[[Phase], None]
OnPass = Callable[[Phase, Sequence[int], Sequence[int], torch.Tensor], None]
"""Called before each forward pass with (phase, prompt rows, tokens of each row, the token ids fed), in the
pass's token order (row-major, padding left out)."""


def ignore_phase(phase: Phase) -> None:
    """The `on_phase` of runs that keep no per-phase counters."""


def ignore_pass(phase: Phase, rows: Sequence[int], counts: Sequence[int], token_ids_N: torch.Tensor) -> None:
    """The `on_pass` of runs that neither record a trace nor prefetch."""


@dataclass
class SequenceState:
    """One prompt's progress. Text is released to the stream only once no stop string can still change it."""

    prompt_ids: list[int]
    out_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    finish_reason: FinishReason | None = None

    @property
    def position(self) -> int:
        """Cache index of the next token fed to the model."""
        return len(self.prompt_ids) + len(self.out_ids) - 1


class TextTracker:
    """Detokenizes a row's tokens, applies stop strings, and streams text that is final."""

    def __init__(self, detokenize: Detokenize | None, params: SamplingParams, on_text: OnText | None):
        self.detokenize = detokenize
        self.stop = params.stop
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.on_text = on_text

    def update(self, row: int, seq: SequenceState) -> None:
        if self.detokenize is None or (self.on_text is None and not self.stop and seq.finish_reason is None):
            return  # nobody streams and no stop string can end it early: decode once, when it finishes
        text = self.detokenize(seq.out_ids)
        for s in self.stop:
            cut = text.find(s)
            if cut != -1:
                text, seq.finish_reason = text[:cut], "stop"
        seq.text = text
        final = len(text) if seq.finish_reason else max(seq.emitted, len(text.rstrip("\ufffd")) - self.holdback)
        if self.on_text is not None and final > seq.emitted:
            self.on_text(row, text[seq.emitted:final])
        seq.emitted = max(seq.emitted, final)


def generate_ids(model: CausalLM, prompts: Sequence[list[int]], params: SamplingParams, eos_ids: Sequence[int],
                 stats: RunStats, detokenize: Detokenize | None = None, on_text: OnText | None = None,
                 device: torch.device | str = "cpu", on_phase: OnPhase = ignore_phase,
                 on_pass: OnPass = ignore_pass, kv: KVCachePool | None = None) -> list[SequenceState]:
    """Generate for every prompt; fills `stats` with timings and announces each phase through `on_phase`. The
    KV cache comes from `kv` (reused across calls) or is allocated for this call."""
    dev = torch.device(device)
    t0 = time.perf_counter()
    seqs = [SequenceState(list(p)) for p in prompts]
    lens = torch.tensor([len(p) for p in prompts])
    b, t = len(prompts), int(lens.max())
    sampler, tracker = Sampler(params, b), TextTracker(detokenize, params, on_text)
    eos = set() if params.ignore_eos else set(eos_ids)
    window = model.config.sliding_window
    length = t + params.max_tokens
    cache = kv.get(b, length) if kv is not None else model.make_cache(b, length, next(model.parameters()).dtype, dev)
    ids_BT = torch.zeros(b, t, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids_BT[i, : len(p)] = torch.tensor(p)
    positions_BT = torch.arange(t).expand(b, t)
    batch = ForwardBatch.build(positions_BT.to(dev), valid_BT=(positions_BT < lens[:, None]).to(dev),
                               sliding_window=window, kv_len=t)
    with torch.inference_mode():
        on_phase("prefill")
        on_pass("prefill", range(b), lens.tolist(), torch.cat([torch.tensor(p, dtype=torch.long) for p in prompts]))
        fed_BT = ids_BT.to(dev)
        logits_BV = model(fed_BT, batch, cache, logits_at_B=(lens - 1).to(dev))
        active = list(range(b))
        stats.prefill_s = time.perf_counter() - t0
        on_phase("decode")
        while True:
            step_start = time.perf_counter()
            try:
                tokens = sampler(logits_BV, active)
            except NonFiniteLogits:
                raise _non_finite(model, fed_BT, batch, cache, len(stats.tpot_s) if stats.ttft_s else None) from None
            for row, token in zip(active, tokens):
                _append(seqs[row], token, eos, params.max_tokens)
                tracker.update(row, seqs[row])
            if not stats.ttft_s:
                stats.ttft_s = time.perf_counter() - t0
            active = [r for r in active if seqs[r].finish_reason is None]
            if not active:
                break
            rows = None if len(active) == b else torch.tensor(active, device=dev)
            positions = [seqs[r].position for r in active]
            batch = ForwardBatch.build(torch.tensor(positions, device=dev)[:, None], rows_B=rows,
                                       sliding_window=window, kv_len=max(positions) + 1)
            fed_BT = torch.tensor([[seqs[r].out_ids[-1]] for r in active], device=dev)
            on_pass("decode", active, [1] * len(active), fed_BT.flatten())
            logits_BV = model(fed_BT, batch, cache, logits_at_B=torch.zeros(len(active), dtype=torch.long, device=dev))
            stats.tpot_s.append(time.perf_counter() - step_start)
    stats.decode_s = sum(stats.tpot_s)
    stats.num_prompts, stats.prompt_tokens = b, int(lens.sum())
    stats.generated_tokens = sum(len(s.out_ids) for s in seqs)
    return seqs


def _non_finite(model: CausalLM, fed_BT: torch.Tensor, batch: ForwardBatch, cache: Sequence[Sequence[torch.Tensor]],
                decode_step: int | None) -> NumericalError:
    where = model.first_non_finite(fed_BT, batch, cache)
    when = "in the prefill" if decode_step is None else f"at decode step {decode_step + 1}"
    return NumericalError(f"the model produced NaN or infinite logits {when}; they first appear in {where}. The "
                          f"checkpoint may hold NaN/inf weights, or the dtype overflows (try --dtype float32)")


def _append(seq: SequenceState, token: int, eos: set[int], max_tokens: int) -> None:
    if token in eos:
        seq.finish_reason = "stop"
        return
    seq.out_ids.append(token)
    if len(seq.out_ids) >= max_tokens:
        seq.finish_reason = "length"
