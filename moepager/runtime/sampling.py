"""Sampling parameters (validated) and per-request samplers: greedy, or seeded temperature / top-k / top-p /
min-p sampling, with repetition, presence and frequency penalties and log-probabilities.

Order of the logits processing (llama.cpp's and transformers' order): penalties, then temperature, then the
top-k, top-p and min-p filters, then a draw from the request's own seeded generator. Log-probabilities are the
model's (after penalties, before temperature and filters), as the OpenAI API reports them.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from moepager.accel import cpu_kernels
from moepager.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop."""

    max_tokens: int = 64
    """Most tokens to generate per prompt."""
    temperature: float = 0.0
    """0 means greedy (argmax); otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0 disables."""
    top_p: float = 1.0
    """Sample among the smallest set of tokens whose probability reaches p; 1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's; 0 disables."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens already in the prompt or output by this; 1 disables
    (the CTRL paper's penalty, as transformers and llama.cpp apply it)."""
    presence_penalty: float = 0.0
    """Subtract this from the logit of every token already generated (OpenAI's definition, -2..2)."""
    frequency_penalty: float = 0.0
    """Subtract this times the number of times a token was generated (OpenAI's definition, -2..2)."""
    seed: int | None = None
    """Seed of the sampler; request i of a batch uses seed + i. None draws a random seed."""
    stop: tuple[str, ...] = ()
    """Generation of a prompt ends before the first occurrence of any of these strings."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (benchmarks)."""
    logprobs: int | None = None
    """Report each sampled token's log-probability and this many most likely alternatives (0: the token's only);
    None reports none."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not math.isfinite(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2 <= value <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -SEED_RANGE <= self.seed < SEED_RANGE):
            raise InvalidRequestError(f"seed must be an integer in [-2**63, 2**63 - 2**16), got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise InvalidRequestError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0, or one below GREEDY_BELOW (where fp32 cannot divide by it; sampling at it would
        pick the argmax anyway, up to exact ties)."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


GREEDY_BELOW = float(torch.finfo(torch.float32).tiny)
"""Temperatures below the smallest normal fp32 (1.2e-38) act as greedy: fp32 holds them only as subnormals, or not
at all (under 1.4e-45 they round to 0, and a logit divided by one is infinite or NaN)."""
FP32_MAX = float(torch.finfo(torch.float32).max)

SEED_RANGE = 2**63 - 2**16
"""Seeds are 64-bit signed integers (OpenAI's), less room for the + i of a batch's request i."""

LLAMA_CPP_SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
"""llama.cpp's default sampler chain (common/common.h): what `chat`, `serve` and `generate` use unless told."""


def llama_cpp_sampling(temperature: float | None, top_k: int | None, top_p: float | None, min_p: float | None,
                       **fields: object) -> SamplingParams:
    """Sampling parameters with llama.cpp's defaults filling the filters not given (none of them when greedy:
    `temperature` 0); `fields` are SamplingParams' other fields."""
    given = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p))
             if v is not None}
    defaults = {} if temperature == 0 else LLAMA_CPP_SAMPLING
    return SamplingParams(**{**defaults, **given}, **fields)  # type: ignore[arg-type]


class TokenLogprobs(dict[int, float]):
    """A sampled token's log-probability under key `token`, and its most likely alternatives' under theirs."""

    def __init__(self, token: int, values: dict[int, float]):
        super().__init__(values)
        self.token = token


class RequestSampler:
    """One request's token picker: its parameters and its own seeded generator (so a request draws the same
    tokens alone or inside any batch)."""

    def __init__(self, params: SamplingParams, seed_offset: int = 0):
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.seed = seed + seed_offset
        self.generator = torch.Generator().manual_seed(self.seed)
        self.plain = params.greedy and not params.penalised and params.logprobs is None
        """Greedy with nothing to adjust or report: the batch's one argmax decides."""

    @property
    def filters(self) -> tuple[float, int, float, float]:
        """What shapes the distribution this request samples from: rows that share it are filtered together."""
        p = self.params
        return p.temperature, p.top_k, p.top_p, p.min_p


def greedy_picks(logits_BV: torch.Tensor) -> list[list[int]]:
    """[tokens, finite]: each row's first largest logit and whether the row is finite (1) or holds NaN or infinity
    (0). On the CPU with moepager's kernels loaded, one call (accel/csrc/step.cpp `greedy_rows`: the same picks),
    else five torch ops on fp32 logits."""
    kernels = cpu_kernels.built()
    if kernels is not None and logits_BV.device.type == "cpu" and logits_BV.dtype in (torch.bfloat16, torch.float32) \
            and logits_BV.is_contiguous():
        return kernels.greedy_rows(logits_BV).tolist()
    logits_BV = logits_BV.float()  # CPU argmax and isfinite of bf16 cost several times more than of fp32
    # max(dim) gives argmax's index (the first of equal maxima) faster than argmax at a large vocabulary; NaN
    # propagates through max and amin, +inf shows in the max and -inf in the min
    best_B, tokens_B = logits_BV.max(dim=-1)
    finite_B = best_B.isfinite() & logits_BV.amin(dim=-1).isfinite()
    return torch.stack((tokens_B, finite_B.long())).tolist()


Sample = tuple[int, "TokenLogprobs | None"]


def sample_rows(logits_BV: torch.Tensor, requests: Sequence[Sampled]) -> list[Sample | NonFiniteLogits]:
    """Next token of each row (row b for `requests[b]`). Plain greedy rows are decided in one argmax (the host
    sync that also checks every row is finite). The others are penalised row by row on the host, then rows that
    sample with the same filters get their candidates together (`candidates` is row-independent, so a request
    draws the same token alone or in any batch), each drawing from its own generator.

    A row whose logits hold NaN or infinity gets NonFiniteLogits in its place, and the others their tokens."""
    tokens, finite = greedy_picks(logits_BV)
    out: list[Sample | NonFiniteLogits] = list(zip(tokens, itertools.repeat(None)))
    slow = []
    for b, r in enumerate(requests):  # loops, not comprehensions, on the one-token path: each is a call
        if not finite[b]:
            out[b] = NonFiniteLogits([b])
        elif not r.sampler.plain:
            slow.append(b)
    if not slow:
        return out
    host_BV = logits_BV[slow].float().cpu()
    groups: dict[tuple[float, int, float, float], list[int]] = {}
    for i, b in enumerate(slow):
        r = requests[b]
        if r.sampler.params.penalised:
            host_BV[i] = penalised(host_BV[i], r.prompt_ids, r.out_ids, r.sampler.params)
        if r.sampler.params.greedy:
            tokens[b] = int(host_BV[i].argmax())
        else:
            groups.setdefault(r.sampler.filters, []).append(i)
    for rows in groups.values():
        probs_GC, ids_GC = candidates(host_BV[rows], requests[slow[rows[0]]].sampler.params)
        for g, i in enumerate(rows):
            choice = torch.multinomial(probs_GC[g], 1, generator=requests[slow[i]].sampler.generator)
            tokens[slow[i]] = int(ids_GC[g, choice])
    for i, b in enumerate(slow):
        top = requests[b].sampler.params.logprobs
        out[b] = (tokens[b], None if top is None else token_logprobs(host_BV[i], tokens[b], top))
    return out


class Sampled(Protocol):
    """What the sampler reads of a request."""

    sampler: RequestSampler
    prompt_ids: list[int]
    out_ids: list[int]


class NonFiniteLogits(Exception):
    """A row whose logits hold NaN or infinity; the engine fails its request (or, when every row of the pass has them,
    the step, with a NumericalError naming where they began)."""

    def __init__(self, rows: list[int]):
        super().__init__(f"non-finite logits in rows {rows}")
        self.rows = rows


def penalised(logits_V: torch.Tensor, prompt: Sequence[int], generated: Sequence[int], p: SamplingParams
              ) -> torch.Tensor:
    """Repetition penalty over the prompt and output; presence and frequency penalties over the output. Computed in
    float64 (a penalty of 1e-300 or 1e300 is exact there; in fp32 it is 0 or infinity, and 0 * infinity is NaN),
    the result clamped to fp32's finite range: a logit a penalty pushed past it stays the largest (or smallest)."""
    out_V = logits_V.double()
    if p.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt) | set(generated)), dtype=torch.long)
        values = out_V[seen]
        out_V[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and generated:
        counts_V = torch.bincount(torch.tensor(list(generated), dtype=torch.long), minlength=out_V.shape[0])
        out_V -= p.frequency_penalty * counts_V + p.presence_penalty * (counts_V > 0)
    return out_V.clamp(-FP32_MAX, FP32_MAX).to(logits_V.dtype)


def token_logprobs(logits_V: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    logp_V = torch.log_softmax(logits_V.float(), dim=-1)
    values = {token: float(logp_V[token])}
    if top:
        best = torch.topk(logp_V, top)
        values.update(zip(best.indices.tolist(), best.values.tolist()))
    return TokenLogprobs(token, values)


def candidates(logits_BV: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the tokens sampling may pick, most likely first, and their probabilities (zero for the dropped
    ones): the top-k (all tokens when top_k is 0) at temperature, cut to the top-p mass and the min-p share of the
    best (llama.cpp's chain, which also sorts only the top-k candidates: cheap next to sorting the vocabulary)."""
    if p.top_k and p.top_k < logits_BV.shape[-1]:
        values_BC, ids_BC = torch.topk(logits_BV, p.top_k, dim=-1)
    else:
        values_BC, ids_BC = torch.sort(logits_BV, dim=-1, descending=True)
    # the largest logit subtracted first: every scaled logit is <= 0 (or -inf), so no temperature >= GREEDY_BELOW
    # overflows the softmax (dividing the logits themselves by 1e-40 gave inf and then NaN probabilities)
    probs_BC = torch.softmax((values_BC - values_BC[:, :1]) / p.temperature, dim=-1)
    keep_BC = torch.ones_like(probs_BC, dtype=torch.bool)
    if p.top_p < 1.0:
        keep_BC &= probs_BC.cumsum(-1) - probs_BC < p.top_p  # the mass before this token is still short of p
    if p.min_p > 0:
        keep_BC &= probs_BC >= p.min_p * probs_BC[:, :1]
    keep_BC[:, 0] = True  # the most likely token always: a top_p fp32 rounds to 0 (1e-187) would keep none
    probs_BC = probs_BC * keep_BC
    return probs_BC / probs_BC.sum(-1, keepdim=True), ids_BC


def filtered_probs(logits_BV: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The full distribution `candidates` samples from (zero outside the candidates)."""
    probs_BC, ids_BC = candidates(logits_BV.float(), p)
    return torch.zeros_like(logits_BV, dtype=torch.float32).scatter(1, ids_BC, probs_BC)
