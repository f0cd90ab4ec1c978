"""Sampling parameters (validated) and the sampler: greedy, or seeded temperature / top-k / top-p."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

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
    seed: int | None = None
    """Seed of the sampler; request i of a batch uses seed + i. None draws a random seed."""
    stop: tuple[str, ...] = ()
    """Generation of a prompt ends before the first occurrence of any of these strings."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (benchmarks)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Picks next tokens for a batch; rows keep their own seeded generator across steps."""

    def __init__(self, params: SamplingParams, rows: int):
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.seed = seed
        self.generators = [torch.Generator().manual_seed(seed + i) for i in range(rows)]

    def __call__(self, logits_BV: torch.Tensor, rows: Sequence[int]) -> list[int]:
        """Next token of each batch row; `rows[b]` names the request (and generator) of row b.

        Raises NonFiniteLogits when a row's logits hold NaN or infinity (checked in the same host sync that
        fetches the tokens)."""
        if self.params.greedy:
            picked = torch.stack((logits_BV.argmax(dim=-1), torch.isfinite(logits_BV).all(dim=-1).long())).tolist()
            if not all(picked[1]):
                raise NonFiniteLogits([r for r, ok in zip(rows, picked[1]) if not ok])
            return picked[0]
        logits_BV = logits_BV.float().cpu()
        finite_B = torch.isfinite(logits_BV).all(dim=-1)
        if not bool(finite_B.all()):
            raise NonFiniteLogits([r for r, ok in zip(rows, finite_B.tolist()) if not ok])
        probs_BV = filtered_probs(logits_BV, self.params)
        return [int(torch.multinomial(probs_BV[b], 1, generator=self.generators[r])) for b, r in enumerate(rows)]


class NonFiniteLogits(Exception):
    """Raised by the sampler; the generation loop turns it into a NumericalError naming where it began."""

    def __init__(self, rows: list[int]):
        super().__init__(f"non-finite logits in rows {rows}")
        self.rows = rows


def filtered_probs(logits_BV: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Softmax of logits / temperature restricted to the top-k and top-p sets."""
    logits_BV = logits_BV / p.temperature
    if p.top_k and p.top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, p.top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
        cum_BV = torch.softmax(sorted_BV, dim=-1).cumsum(dim=-1)
        drop_BV = cum_BV - torch.softmax(sorted_BV, dim=-1) >= p.top_p  # mass before this token already >= p
        logits_BV = logits_BV.scatter(1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    return torch.softmax(logits_BV, dim=-1)
