"""The predictor seam: observe what the model routed, forecast which experts come next.

A forward pass (an *iteration*) carries N rows: one token of each request in decode, or a whole prompt's
tokens at prefill (offline evaluation feeds a request's tokens as rows of one iteration: row t's "next
iteration" is row t+1). Protocol, per iteration:
1. `start_iteration(token_ids_N, sem_ND)` — the rows' tokens and a semantic embedding of each row's request
   so far (fMoE; the engine pools the model's embedding layer, traces hash their token strings);
2. for each MoE layer i in order (i is the position among MoE layers, 0..L-1): `observe(i, obs)` with the
   router's input, its full distribution and the chosen experts;
3. any time: `forecast(j, ahead)` — per row, a probability over experts of MoE layer j in this iteration
   (`ahead` 0, j after the last observed layer) or in the row's next iteration (`ahead` 1), from what has
   been observed so far; None when the predictor cannot forecast that target.
A forecast made after observing layer i for layer j of this iteration is at distance j - i; for layer j of the
next iteration at distance L - i + j. Predictors keep no state across iterations, so the same object serves
the engine (rows = batch) and offline evaluation (rows = one request's tokens). The one exception is
declared `stateful` in its registry entry (the path predictor's per-request state): the engine then calls
`begin_rows(requests, starts, counts, phases)` before each `start_iteration` and `end_request(request)` when a
request finishes; offline evaluation does the same with a request's prompt and its generated tokens as two rows.
Shape legend: N rows, D hidden, E experts, K top-k, L MoE layers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from moepager.errors import MoepagerError


@dataclass(frozen=True)
class LayerObservation:
    probs_NE: torch.Tensor
    """The router's distribution over experts (float32; a K-hot / K stand-in where a trace has no gates)."""
    ids_NK: torch.Tensor
    """The experts chosen (where the model computes for a predictor whose `hidden` is "device", on the host
    otherwise)."""
    x_ND: torch.Tensor | None = None
    """The router's input (hidden state); None where it was not recorded."""


@dataclass(frozen=True)
class Forecast:
    probs_NE: torch.Tensor
    """Per row, how likely each expert is to be chosen (rows sum to about 1; only the order matters for top-k)."""
    confidence_N: torch.Tensor | None = None
    """fMoE: similarity of the matched expert map in [-1, 1]; selects how many experts to prefetch."""

    def top(self, k: int) -> torch.Tensor:
        """ids_Nk of the k most likely experts per row, most likely first."""
        return torch.topk(self.probs_NE, min(k, self.probs_NE.shape[1]), dim=1).indices

    def sizes(self, k: int) -> torch.Tensor:
        """How many experts to prefetch per row: k, or with a confidence fMoE's rule (Yu et al. 2025, eqs. 6-8):
        the fewest most-likely experts whose probabilities sum to delta = clip(1 - similarity, 0, 1), and at
        least k of them (a tolerance absorbs rounding when delta is 1)."""
        num_experts = self.probs_NE.shape[1]
        if self.confidence_N is None:
            return torch.full((self.probs_NE.shape[0],), min(k, num_experts))
        mass_NE = torch.cumsum(torch.sort(self.probs_NE, dim=1, descending=True).values, dim=1)
        delta_N = torch.clamp(1 - self.confidence_N.float(), 0, 1) - 1e-6
        count_N = (mass_NE < delta_N[:, None]).sum(1) + 1
        return torch.clamp(count_N, min=min(k, num_experts), max=num_experts)

    def selection(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(order_NE, keep_NE): experts most likely first, and which of them are selected (the first `sizes`)."""
        order_NE = torch.argsort(self.probs_NE, dim=1, descending=True)
        keep_NE = torch.arange(order_NE.shape[1])[None, :] < self.sizes(k)[:, None]
        return order_NE, keep_NE

    def select(self, k: int) -> list[list[int]]:
        """The experts to prefetch per row, most likely first."""
        return [[e for e, _ in row] for row in self.chosen(k)]

    def chosen(self, k: int) -> list[list[tuple[int, float]]]:
        """The experts to prefetch per row with their probabilities, most likely first (read off the device
        in one copy each: the prefetcher weighs its queue by them at every layer)."""
        if self.confidence_N is None:  # k per row: the top k (what `selection` keeps, without its masks)
            top = torch.topk(self.probs_NE, min(k, self.probs_NE.shape[1]), dim=1)
            return [list(zip(ids, ps)) for ids, ps in zip(top.indices.tolist(), top.values.tolist())]
        values_NE, order_NE = torch.sort(self.probs_NE, dim=1, descending=True)  # `selection`'s order
        sizes = self.sizes(k).tolist()
        return [list(zip(ids[:n], ps[:n])) for ids, ps, n in zip(order_NE.tolist(), values_NE.tolist(), sizes)]

    def rows(self, index: list[int] | slice) -> Forecast:
        """The forecast for some rows only."""
        confidence = self.confidence_N[index] if self.confidence_N is not None else None
        return Forecast(self.probs_NE[index], confidence)


class Predictor(Protocol):
    name: str
    """Registry name (reports)."""
    needs_scores: bool
    """`observe` reads the router's scores (`probs_NE`); otherwise the engine does not copy them off the device."""
    hidden: Literal["host", "device"] | None
    """Where `observe` wants the router's input `x_ND`: copied to the host, left where the model computes (its
    routers run there: gate lookahead), or not at all."""
    semantic: Literal["embedding", "hashed-tokens"] | None
    """The semantic embedding `start_iteration` needs per row: the model's token embeddings pooled over the
    request ("embedding"), hashed token ids ("hashed-tokens", stores fitted on traces), or none."""

    def start_iteration(self, token_ids_N: torch.Tensor, sem_ND: torch.Tensor | None) -> None: ...

    def observe(self, layer: int, obs: LayerObservation) -> None: ...

    def forecast(self, layer: int, ahead: int) -> Forecast | None: ...


class PredictorError(MoepagerError):
    """A predictor cannot be built or used as asked (missing activations, wrong shapes, unknown name)."""


def stable_hash(token: str | int) -> int:
    """A 64-bit hash of a token (id or string) that is the same in every process (Python's hash() is salted):
    what the hashed-token features of expert maps, the head and the path predictor key on."""
    return int.from_bytes(hashlib.blake2b(str(token).encode(), digest_size=8).digest(), "little")


def token_keys(tokens: Sequence[str] | Sequence[int]) -> torch.Tensor:
    """The ids a predictor's `start_iteration` takes for some recorded tokens: ids as they are, a stable 63-bit
    hash of each string (a trace of token strings: fitting, evaluation and replays see the same ids)."""
    return torch.tensor([t if isinstance(t, int) else stable_hash(t) >> 1 for t in tokens], dtype=torch.long)


def k_hot(ids_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """probs_NE with 1/K on each chosen expert: the stand-in distribution for traces without gate scores."""
    out = torch.zeros(ids_NK.shape[0], num_experts)
    valid = ids_NK >= 0
    out.scatter_add_(1, ids_NK.clamp(min=0).long(), valid.float())
    return out / valid.sum(1, keepdim=True).clamp(min=1)


def target_of(layer: int, distance: int, num_layers: int) -> tuple[int, int]:
    """(target layer, ahead) of a forecast made after observing `layer` at `distance` MoE layers."""
    if not 1 <= distance <= num_layers:
        raise PredictorError(f"prefetch distance must be in 1..{num_layers} MoE layers, got {distance}")
    target = layer + distance
    return (target, 0) if target < num_layers else (target - num_layers, 1)
