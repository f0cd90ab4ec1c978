"""A request as the engine tracks it: its tokens, sampler, stop conditions, KV blocks and statistics.

A request's tokens are its prompt then its output; `num_computed` of them are in the KV cache. Each step feeds
the next uncomputed ones (a chunk of the prompt, or the last output token when decoding); a preempted request
loses its cache and computes its tokens again from the start, so its output is unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from moepager.runtime.sampling import RequestSampler, SamplingParams, TokenLogprobs

FinishReason = Literal["stop", "length", "abort"]
Detokenize = Callable[[Sequence[int]], str]


class Preempted(Protocol):
    preemptions: int
    """Times the request lost its cache to another and computed its tokens again."""


class SchedulableRequest(Protocol):
    """What a scheduled row's request is to the runner (runtime/runner.py): its id, cache blocks, tokens. The
    engine's `Request`, the simulator's stand-in (runtime/step_order.py) and the shadow's (runtime/shadow.py)."""

    request_id: int
    blocks: list[int]
    """KV cache blocks holding its positions, in order."""
    num_computed: int
    """Tokens whose keys and values are in the cache."""

    @property
    def num_tokens(self) -> int: ...

    def tokens(self, start: int, count: int) -> list[int]: ...


class QueuedRequest(SchedulableRequest, Protocol):
    """What the scheduler (runtime/scheduler.py) and its batch policy read of a request besides: its output so far,
    what is left to compute, its preemptions. The engine's `Request` and the simulator's stand-in."""

    out_ids: list[int]

    @property
    def remaining(self) -> int: ...

    @property
    def stats(self) -> Preempted: ...


@dataclass
class RequestStats:
    """Times (perf_counter seconds) of one request's life."""

    arrival_s: float = field(default_factory=time.perf_counter)
    scheduled_s: float | None = None
    first_token_s: float | None = None
    token_s: list[float] = field(default_factory=list)
    """When each output token was sampled."""
    finished_s: float | None = None
    preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        return [b - a for a, b in zip(self.token_s, self.token_s[1:])]


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: new tokens and the text that became final."""

    request_id: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs]
    finish_reason: FinishReason | None
    error: Exception | None = None
    """Why this request alone failed (its logits were not finite); it finishes as "abort", and the rows beside it
    go on."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class TextTracker:
    """Detokenizes a request's output, applies stop strings, and releases text only once no stop string can
    still change it. Without stop strings and streaming it detokenizes once, when the request finishes."""

    def __init__(self, detokenize: Detokenize | None, stop: Sequence[str], stream: bool):
        self.detokenize = detokenize
        self.stop = tuple(stop)
        self.every_step = stream or bool(stop)
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0

    def update(self, out_ids: Sequence[int], finished: bool) -> tuple[str, bool]:
        """New final text, and whether a stop string ended the request."""
        if self.detokenize is None or not (finished or self.every_step):
            return "", False
        text, stopped = self.detokenize(out_ids), False
        for s in self.stop:
            cut = text.find(s)
            if cut != -1:
                text, stopped = text[:cut], True
        self.text = text
        final = len(text) if finished or stopped else max(self.emitted, len(text.rstrip("\ufffd")) - self.holdback)
        new = text[self.emitted:final] if final > self.emitted else ""
        self.emitted = max(self.emitted, final)
        return new, stopped


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    sampler: RequestSampler
    text: TextTracker
    eos_ids: frozenset[int]
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_computed: int = 0
    """Tokens (prompt, then output) whose keys and values are in the cache."""
    blocks: list[int] = field(default_factory=list)
    """KV cache blocks holding this request's positions, in order."""
    finish_reason: FinishReason | None = None
    stats: RequestStats = field(default_factory=RequestStats)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.out_ids)

    @property
    def max_len(self) -> int:
        """Positions the cache must hold by the end: the prompt, then every output token but the last."""
        return len(self.prompt_ids) + self.params.max_tokens - 1

    def tokens(self, start: int, count: int) -> list[int]:
        """Tokens start..start+count-1 of the prompt followed by the output, without joining the two."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.out_ids[start - n:start - n + count]
        return self.prompt_ids[start:start + count] + self.out_ids[:max(0, start + count - n)]

    @property
    def remaining(self) -> int:
        """Tokens not yet in the cache: the prompt (or a chunk's rest), or the one output token to decode."""
        return self.num_tokens - self.num_computed

    def append(self, token: int, logprobs: TokenLogprobs | None, now: float) -> RequestOutput:
        """Record a sampled token; decide whether the request ends."""
        if self.stats.first_token_s is None:
            self.stats.first_token_s = now
        self.stats.token_s.append(now)
        new_ids: list[int] = []
        if token in self.eos_ids and not self.params.ignore_eos:
            self.finish_reason = "stop"
        else:
            self.out_ids.append(token)
            new_ids = [token]
            if logprobs is not None:
                self.logprobs.append(logprobs)
            if len(self.out_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
        text, stopped = self.text.update(self.out_ids, self.finish_reason is not None)
        if stopped:
            self.finish_reason = "stop"
        return RequestOutput(self.request_id, new_ids, text, self.logprobs[-1:] if new_ids and logprobs else [],
                             self.finish_reason)
