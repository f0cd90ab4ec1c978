"""A learned linear head over several routing sources: the baseline a predictor has to beat on real traces.

A co-occurrence table forecasts layer j from the experts of one source layer, one expert at a time: it adds
the rows P(e' at j | e at i) of the experts chosen at i. On real routing the set of experts chosen at the
last few layers says much more than its members taken one by one, and the token itself says more again.
This head is a logistic model, one per (target layer, distance), over:
- the experts chosen at the last three observed layers (multi-hot, `SOURCES` slots);
- for a target in the row's next iteration (ahead 1), the experts the row chose at the target layer itself
  (the previous token's routing at that layer);
- the token of the row being observed, hashed into `buckets`, through a shared low-rank embedding
  (`rank` wide, one projection per target layer); optional, and left out where the engine will not see the
  trace's tokens (a model with another tokenizer; a routing replay hands predictors the trace's own).
logits_E = bias_j + sum over slots s of W_js[chosen experts at s] + proj_j(embed(bucket)). With `hidden` H > 0
a one-hidden-layer MLP per target layer over the same inputs is added to those logits: + W2_j relu(W1_j x + b1_j),
x = [the slots' multi-hot, embed(bucket)] (it sees which experts occur *together*; measured on DeepSeek-V2-Lite
routing in the README). Trained with binary cross-entropy on the chosen set (multi-label, as ExpertFlow trains its
path predictor), Adam, seeded.
The engine's forecasts compute the same logits without the multi-hot vector: they sum the weight rows of the
experts the slots name (`HeadModel.sparse_tables`), faster for a decode row.
Distance 0 is the "pass" head: before any layer of the row runs, from the token alone (what a stateless
predictor can say about the whole coming pass; the path predictor adds the request's context).
Stateless across iterations like every predictor here: the previous token's routing is only used for
next-iteration targets, where it is the row just observed.
Shape legend: N rows, L MoE layers, S source slots, K top-k, E experts, B token buckets, R rank, C = S * (E + 1)
multi-hot columns, Y = E logits then the MLP's hidden units.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from moepager.predictors.base import Forecast, LayerObservation, PredictorError, stable_hash

SOURCES = 4
"""Source slots: the last three observed layers, and the target layer of the row just observed (ahead 1)."""
GATHER_ROWS = 64
"""Forecasts of at most this many rows sum the weight rows their experts name; more rows (a prefill) multiply a
multi-hot matrix, which reads the table once (on DeepSeek-V2-Lite's MLP head the gather wins up to a few dozen rows
and the product from about a hundred)."""
DEFAULT_BUCKETS = 8192
DEFAULT_RANK = 32
DEFAULT_HIDDEN = 256
DEFAULT_STEPS = 500
"""Optimiser steps a head trains for unless told: about what 4 passes over DeepSeek-V2-Lite's 1,500 training requests
take, where the MLP head was tuned."""
"""The hidden width of the MLP `moepager predictor fit --kind head` adds unless told otherwise (0: linear). On
DeepSeek-V2-Lite's routing it forecast best (recall@6 one layer ahead 61.8% against 60.8% linear with the token) and,
paired against LRU at 25% with one expert a row, paid more than the linear head (benchmarks/README.md#predictors);
it fits several times slower."""


def token_buckets(tokens: Sequence[str | int], buckets: int) -> torch.Tensor:
    """A stable hash of each token (id or string) into 0..buckets-1 (the same for the engine and traces)."""
    out = torch.empty(len(tokens), dtype=torch.long)
    for t, tok in enumerate(tokens):
        out[t] = stable_hash(tok) % buckets
    return out


def source_layers(target: int, distance: int, num_layers: int) -> tuple[list[int], int]:
    """(the source layer of each slot, -1 where absent; ahead) for a forecast of `target` at `distance`
    (0: the pass head, no sources)."""
    if distance == 0:
        return [-1] * SOURCES, 0
    last = target - distance
    ahead = int(last < 0)
    if ahead:
        last += num_layers
    slots = [layer if layer >= 0 else -1 for layer in (last, last - 1, last - 2)]
    return slots + [target if ahead else -1], ahead


@dataclass(frozen=True)
class HeadFit:
    """What `moepager predictor fit --kind ...` takes for this predictor (trace/fit.py fits it)."""

    distances: tuple[int, ...] = (1, 2, 3)
    """Prefetch distances to fit heads for (the pass head, distance 0, is fitted too when the trace has tokens)."""
    steps: int = DEFAULT_STEPS
    """Optimiser steps per head: training is sized by steps, not by passes, so a small trace is not underfitted."""
    epochs: int | None = None
    """Passes over the training tokens instead of `steps`."""
    hidden: int | None = None
    """Width of the hidden layer of an MLP added to the linear head (0: the linear head alone); None: linear or
    DEFAULT_HIDDEN, whichever forecasts `holdout` of the training requests better."""
    holdout: float = 0.15
    """Share of the training requests held out to choose the shape (`hidden` None)."""
    tokens: bool = True
    """Use the token as a feature (off where the engine will not see the trace's tokens: a model with another
    tokenizer; a replay hands predictors the trace's own)."""
    seed: int = 0


class HeadModel(torch.nn.Module):
    """One distance's heads for every target layer."""

    def __init__(self, num_layers: int, num_experts: int, buckets: int, rank: int, tokens: bool, hidden: int = 0):
        super().__init__()
        e = num_experts
        self.num_experts = e
        self.weight = torch.nn.Parameter(torch.zeros(num_layers, SOURCES * (e + 1), e))
        self.bias = torch.nn.Parameter(torch.zeros(num_layers, e))
        self.embed = torch.nn.Embedding(buckets, rank) if tokens else None
        self.proj = torch.nn.Parameter(torch.zeros(num_layers, rank, e)) if tokens else None
        if self.embed is not None:
            torch.nn.init.normal_(self.embed.weight, std=0.1)
        self.hidden = hidden
        if hidden:
            x = SOURCES * (e + 1) + (rank if tokens else 0)
            self.w1 = torch.nn.Parameter(torch.randn(num_layers, x, hidden) * x ** -0.5)
            self.b1 = torch.nn.Parameter(torch.zeros(num_layers, hidden))
            self.w2 = torch.nn.Parameter(torch.zeros(num_layers, hidden, e))  # starts as the linear head

    def forward(self, src_NLSK: torch.Tensor, bucket_NL: torch.Tensor | None) -> torch.Tensor:
        """logits_NLE from source experts (-1 absent) and the observed row's token bucket per target layer."""
        return self.logits(src_NLSK, bucket_NL)

    def logits(self, src_SK: torch.Tensor, bucket: torch.Tensor | None, layer: int | None = None) -> torch.Tensor:
        """Every target layer's logits (layer None: src [..., L, S, K], bucket [..., L] -> [..., L, E]) or one
        layer's (src [..., S, K], bucket [...] -> [..., E]): the same weights, indexed or not."""
        def at(weights: torch.Tensor) -> torch.Tensor:
            return weights if layer is None else weights[layer]
        hot = multi_hot(src_SK, self.num_experts)
        out = _vecmat(hot, at(self.weight)) + at(self.bias)
        emb = self.embed(bucket) if self.embed is not None and bucket is not None else None
        if emb is not None:
            out = out + _vecmat(emb, at(self.proj))
        if self.hidden:
            x = hot if emb is None else torch.cat((hot, emb), -1)
            out = out + _vecmat(torch.relu(_vecmat(x, at(self.w1)) + at(self.b1)), at(self.w2))
        return out

    @torch.no_grad()
    def sparse_tables(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The same weights as forecasts read them (`rows_LCY`, `token_LRY`, `bias_LY`, Y = E logits then the MLP's
        H hidden units): a multi-hot input's product is the sum of the rows of its chosen columns, so a forecast
        gathers the S * K rows its experts name instead of multiplying a vector of S * (E + 1) mostly zeros, and the
        linear part and the MLP's first layer share one gather."""
        e = self.num_experts
        c = SOURCES * (e + 1)
        rows, bias = self.weight.clone(), self.bias
        token = self.proj
        if self.hidden:
            rows, bias = torch.cat((rows, self.w1[:, :c]), -1), torch.cat((bias, self.b1), -1)
            token = None if token is None else torch.cat((token, self.w1[:, c:]), -1)
        rows[:, e::e + 1] = 0.0  # each slot's "absent" column, as multi_hot leaves it: an id of -1 (none) in slot s
        # gathers row s * (E + 1) - 1, the absent row of slot s - 1 (slot 0: of the last slot, row -1)
        return rows, token, bias


def _vecmat(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x_NX @ w_XY for one layer, or each layer's rows times that layer's matrix: x_NLX, w_LXY -> NLY (one batched
    product over L; broadcasting the matmul would copy w once per row)."""
    return x @ w if w.dim() == 2 else torch.einsum("nlx,lxy->nly", x, w)


class HeadPredictor:
    name = "head"
    semantic = None
    needs_scores = False
    hidden = None

    def __init__(self, models: dict[int, HeadModel], num_layers: int, num_experts: int, buckets: int,
                 rank: int, tokens: bool):
        self.models = models
        """distance (0: the pass head) -> HeadModel."""
        self.num_layers, self.num_experts = num_layers, num_experts
        self.buckets, self.rank, self.tokens = buckets, rank, tokens
        self._seen: dict[int, torch.Tensor] = {}
        self._last = -1
        self._bucket_N: torch.Tensor | None = None
        self._tables = {d: m.sparse_tables() for d, m in models.items()}
        """distance -> HeadModel.sparse_tables(), made once: the models are fitted before a predictor holds them."""
        self._base: dict[int, torch.Tensor] = {}
        """distance -> this iteration's bias plus its token's term, [N or 1, L, Y], made at the first forecast."""
        self._offsets: dict[tuple[int, ...], torch.Tensor] = {}
        """(present slots..., top-k) -> each gathered column's slot offset."""

    @property
    def distances(self) -> set[int]:
        return set(self.models)

    def start_iteration(self, token_ids_N: torch.Tensor, sem_ND: torch.Tensor | None) -> None:
        self._seen, self._last, self._base = {}, -1, {}
        self._bucket_N = token_buckets(token_ids_N.tolist(), self.buckets) if self.tokens and len(token_ids_N) \
            else None

    def observe(self, layer: int, obs: LayerObservation) -> None:
        self._seen[layer] = obs.ids_NK.long()
        self._last = layer

    @torch.no_grad()
    def forecast(self, layer: int, ahead: int) -> Forecast | None:
        if self._last < 0:
            distance = 0 if ahead == 0 else None
        else:
            distance = layer - self._last if ahead == 0 else self.num_layers - self._last + layer
        model = self.models.get(distance) if distance is not None else None
        if model is None:
            return None
        rows = self._rows()
        if rows == 0:
            return None
        slots, _ = source_layers(layer, distance, self.num_layers)
        present = [(i, s) for i, s in enumerate(slots) if s >= 0 and s in self._seen]
        rows_CY = self._tables[distance][0][layer]
        z_NY = self._iteration_base(distance)[:, layer]
        if present and rows <= GATHER_ROWS:
            ids = torch.cat([self._seen[s] for _, s in present], 1)
            z_NY = rows_CY[ids + self._offset([i for i, _ in present], ids.shape[1] // len(present))].sum(1) + z_NY
        elif present:  # many rows (a prefill): the multi-hot product reads the table once, not once a row
            k = self._seen[present[0][1]].shape[1]
            src = torch.stack([self._seen[s] if s >= 0 and s in self._seen else torch.full((rows, k), -1)
                               for s in slots], 1)
            z_NY = multi_hot(src, self.num_experts) @ rows_CY + z_NY
        e = self.num_experts
        out = z_NY[:, :e]
        if model.hidden:
            out = out + torch.relu(z_NY[:, e:]) @ model.w2[layer]
        probs = torch.sigmoid(out)
        return Forecast(probs if len(probs) == rows else probs.expand(rows, e).contiguous())

    def _iteration_base(self, distance: int) -> torch.Tensor:
        """The bias and, with tokens, the iteration's token term of every target layer: [N or 1, L, Y]."""
        base = self._base.get(distance)
        if base is None:
            _, token, bias = self._tables[distance]
            model = self.models[distance]
            base = bias[None]
            if token is not None and model.embed is not None and self._bucket_N is not None:
                base = base + torch.einsum("nr,lry->nly", model.embed(self._bucket_N), token)
            self._base[distance] = base
        return base

    def _offset(self, slots: list[int], k: int) -> torch.Tensor:
        """Each of the gathered columns' first row: slot s's experts are the block s * (E + 1) onwards."""
        key = (*slots, k)
        offset = self._offsets.get(key)
        if offset is None:
            offset = self._offsets[key] = torch.tensor([s * (self.num_experts + 1) for s in slots for _ in range(k)])
        return offset

    def _rows(self) -> int:
        if self._seen:
            return len(next(iter(self._seen.values())))
        return 0 if self._bucket_N is None else len(self._bucket_N)

    def save(self, path: str | Path) -> None:
        torch.save({"kind": self.name, "num_layers": self.num_layers, "num_experts": self.num_experts,
                    "buckets": self.buckets, "rank": self.rank, "tokens": self.tokens,
                    "hidden": next(iter(self.models.values())).hidden if self.models else 0,
                    "models": {str(d): m.state_dict() for d, m in self.models.items()}}, path)

    @classmethod
    def from_state(cls, state: dict) -> HeadPredictor:
        models = {}
        for d, weights in state["models"].items():
            model = HeadModel(state["num_layers"], state["num_experts"], state["buckets"], state["rank"],
                              state["tokens"], state.get("hidden", 0))  # files from before the MLP: linear
            model.load_state_dict(weights)
            models[int(d)] = model.eval()
        return cls(models, state["num_layers"], state["num_experts"], state["buckets"], state["rank"],
                   state["tokens"])


def multi_hot(src_SK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[..., S, K] expert ids (-1 absent) -> [..., S * (E + 1)]: one block of E + 1 columns per slot, a 1 for each
    chosen expert; the last column of a block stands for "absent" and is left 0, so it carries no weight."""
    e = num_experts
    col = (src_SK.clamp(min=-1) % (e + 1)) + torch.arange(src_SK.shape[-2])[:, None] * (e + 1)
    hot = torch.zeros(*src_SK.shape[:-2], src_SK.shape[-2] * (e + 1)).scatter_(-1, col.flatten(-2), 1.0)
    hot[..., e::e + 1] = 0.0
    return hot


def training_pairs(ids_NLK: torch.Tensor, request_N: torch.Tensor, bucket_N: torch.Tensor | None,
                   distance: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(src_NLSK, bucket_NL of the observed row, target ids_NLK, valid_NL) for one distance over N tokens of
    several requests (rows in order within each request). The observed row is the target's own row (ahead 0)
    or the one before it (ahead 1); a next-iteration target whose row has no previous row in the same request
    is not valid."""
    n, num_layers, k = ids_NLK.shape
    ids = ids_NLK.long()
    prev = torch.full_like(ids, -1)
    has_prev = torch.zeros(n, dtype=torch.bool)
    has_prev[1:] = request_N[1:] == request_N[:-1]
    prev[1:][has_prev[1:]] = ids[:-1][has_prev[1:]]
    bucket_NL = None
    if bucket_N is not None:
        bucket_NL = bucket_N[:, None].repeat(1, num_layers)
    src = torch.full((n, num_layers, SOURCES, k), -1, dtype=torch.long)
    valid = torch.ones(n, num_layers, dtype=torch.bool)
    for j in range(num_layers):
        slots, ahead = source_layers(j, distance, num_layers)
        rows = prev if ahead else ids
        for s, layer in enumerate(slots):
            if layer >= 0:
                src[:, j, s] = rows[:, layer]
        if ahead:
            valid[:, j] = has_prev
            if bucket_NL is not None:
                bucket_NL[1:, j] = bucket_N[:-1]
    return src, bucket_NL, ids, valid


def passes_for(steps: int, rows: int, batch: int) -> int:
    """Passes over `rows` training rows in batches of `batch` that make at least `steps` optimiser steps."""
    return max(1, math.ceil(steps / max(1, math.ceil(rows / batch))))


def fit_head(ids_NLK: torch.Tensor, request_N: torch.Tensor, num_experts: int, distances: Sequence[int],
             tokens: Sequence[str | int] | None, epochs: int | None = 4, buckets: int = DEFAULT_BUCKETS,
             rank: int = DEFAULT_RANK, hidden: int = 0, batch: int | None = None, lr: float | None = None,
             seed: int = 0, progress: Callable[[int], None] | None = None, steps: int = DEFAULT_STEPS
             ) -> HeadPredictor:
    """Fit one HeadModel per distance (0 = the pass head) on N tokens of several requests (Adam, by default at lr
    0.03 in batches of 2048 rows; the MLP, `hidden` > 0, at lr 0.003 in batches of 1024, the settings it was
    measured with), for `epochs` passes, or (None) for as many passes as `steps` optimiser steps take; progress
    counts passes."""
    if epochs is not None and epochs < 1:
        raise PredictorError(f"the head needs at least one epoch, got {epochs}")
    if steps < 1:
        raise PredictorError(f"the head needs at least one optimiser step, got {steps}")
    if hidden < 0:
        raise PredictorError(f"the head's hidden width must be 0 (linear) or more, got {hidden}")
    lr = lr if lr is not None else 0.003 if hidden else 0.03
    batch = batch or (1024 if hidden else 2048)
    num_layers = ids_NLK.shape[1]
    bucket_N = token_buckets(tokens, buckets) if tokens is not None else None
    models = {}
    for d in sorted(set(distances)):
        if d == 0 and bucket_N is None:
            continue  # the pass head has nothing to go on without tokens
        torch.manual_seed(seed)
        model = HeadModel(num_layers, num_experts, buckets, rank, bucket_N is not None, hidden)
        src, bucket_NL, target, valid = training_pairs(ids_NLK, request_N, bucket_N, d)
        y_NLE = torch.zeros(*target.shape[:2], num_experts).scatter_(2, target.clamp(min=0),
                                                                     (target >= 0).float())
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        generator = torch.Generator().manual_seed(seed)
        for _ in range(epochs if epochs is not None else passes_for(steps, len(src), batch)):
            for b in torch.randperm(len(src), generator=generator).split(batch):
                logits = model(src[b], bucket_NL[b] if bucket_NL is not None else None)
                loss = F.binary_cross_entropy_with_logits(logits, y_NLE[b], reduction="none").mean(2)
                loss = (loss * valid[b]).sum() / valid[b].sum().clamp(min=1)
                opt.zero_grad()
                loss.backward()
                opt.step()
            if progress is not None:
                progress(1)
        models[d] = model.eval()
    return HeadPredictor(models, num_layers, num_experts, buckets, rank, bucket_N is not None)
