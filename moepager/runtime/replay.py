"""Routing replay: the model runs for real while every MoE layer's expert choice comes from a recorded trace.

Why: random-weight checkpoints route almost statically, so offloading measured on them describes no real
workload. Replaying a trace recorded from a trained model (DeepSeek-V2-Lite, Mixtral, the engine's own
recordings) on a checkpoint of the same geometry gives real routing with everything else real: attention,
shared experts, dense layers, the store, every policy, predictor and budget.

Algorithm: requests are replayed one after another (batch 1, the simulator's `recorded` order). A request's
prompt is its prefill tokens (or, with `prompt_tokens=N`, its first N tokens: a trace of prompts recorded in
one forward pass replays as decode, valid because with a KV cache token t's routing depends only on tokens up
to t) and it decodes one step per remaining token. Before each forward pass the engine says which requests'
tokens it carries and from which position (`begin_pass`); the replayer slices those tokens' recorded ids, and every
MoE block asks it (`route`) instead of its own router. Weights come from the trace where it has them (Mixtral's
renormalised top-2), otherwise from the model's own router scores at the replayed ids, renormalised to the
total weight the router itself gave its own top-k (so a replay of the model's own routing changes nothing).
Tokens whose recorded ids at a layer are missing (-1) keep the model's own routing there.
Shape legend: T tokens, N tokens of a pass, L MoE layers, K top-k, E experts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import nn

from moepager.models.config import ModelConfig
from moepager.trace.format import MISSING, PREFILL, TraceError, TraceHeader, TraceReader, TraceRequest
from moepager.trace.workload import Cut, chosen_requests, parse_requests
from moepager.types import PassInfo, RoutingDecision

RouteLayers = Literal["match", "first"]
"""match: the trace must have exactly the model's MoE layers; first: replay the trace's first L (a model
built with fewer layers, e.g. `make-model --layers N`)."""
Requests = str | slice | Sequence[int] | None


@dataclass(frozen=True)
class ReplaySpec:
    """What to replay: a trace file, which of its requests, where their prompts end, which layers."""

    trace: str | os.PathLike[str]
    requests: Requests = None
    """"A:B" or a slice (python semantics, end exclusive), a list of indices, or None for every request."""
    prompt_tokens: int | None = None
    """Each request's first N tokens are its prompt, every later token one decode step; None: the trace's own
    prefill/decode phases."""
    layers: RouteLayers = "match"
    decode_steps: int | None = None
    """Decode steps per request (every request must have that many); None: all the trace has."""


@dataclass(frozen=True)
class ReplayRequest:
    index: int
    """Position of the request in the trace file."""
    name: str
    prompt_ids: list[int]
    decode_steps: int
    ids_TLK: np.ndarray
    """Recorded ids of the replayed tokens (prompt, then decode steps), the replayed MoE layers only."""
    weights_TLK: np.ndarray | None
    tokens: list[str] | list[int] | None = None
    """The recorded tokens of the replayed positions (the trace's token ids or strings); None where it has
    neither. Predictors are handed these (`recorded_tokens`): the model's own tokens in a replay are not the
    recorded model's."""

    @property
    def max_tokens(self) -> int:
        """Tokens to generate: one from the prefill, then one per decode step."""
        return self.decode_steps + 1


def check_record_path(spec: ReplaySpec, record_trace: str | os.PathLike[str] | None) -> None:
    """A replay may record what it ran, but never over the trace it reads."""
    if record_trace is not None and Path(record_trace).resolve() == Path(spec.trace).resolve():
        raise TraceError(f"--record-trace {record_trace} is the trace being replayed; write elsewhere")


def check_geometry(header: TraceHeader, cfg: ModelConfig, layers: RouteLayers) -> None:
    """The trace's (MoE layers, experts, top-k) must be the model's; `first` allows a longer trace."""
    trace = (header.num_layers, header.num_experts, header.top_k)
    model = (cfg.num_moe_layers, cfg.num_experts, cfg.top_k)
    fits = trace == model or (layers == "first" and trace[1:] == model[1:] and trace[0] >= model[0])
    if not fits:
        hint = (" (the model has fewer MoE layers: --route-layers first replays the trace's first ones)"
                if trace[1:] == model[1:] and trace[0] > model[0] else "")
        raise TraceError(
            f"trace geometry does not match the model: trace {trace[0]} MoE layers x {trace[1]} experts, top-"
            f"{trace[2]}; model {model[0]} MoE layers x {model[1]} experts, top-{model[2]}{hint}")


def load_replay(spec: ReplaySpec, cfg: ModelConfig) -> list[ReplayRequest]:
    """Read and check the requests to replay (all of them, before anything runs)."""
    requests = parse_requests(spec.requests) if isinstance(spec.requests, str) else spec.requests
    cut = Cut(spec.prompt_tokens, spec.decode_steps, cfg.num_moe_layers if spec.layers == "first" else None)
    with TraceReader(spec.trace) as reader:
        check_geometry(reader.header, cfg, spec.layers)
        return [_request(cut.apply(reader.request(i), i), i, cfg)
                for i in chosen_requests(requests, len(reader), spec.trace)]


def _request(req: TraceRequest, i: int, cfg: ModelConfig) -> ReplayRequest:
    prompt = int((req.phase_T == PREFILL).sum())
    if prompt == 0:
        raise TraceError(f"trace request {i} ('{req.name}') has no prompt (prefill) tokens, only decode steps; "
                         f"say how many of its tokens form the prompt with --route-prompt N")
    ids = req.token_ids_T
    if ids is None or len(ids) == 0 or ids.min() < 0 or ids.max() >= cfg.vocab_size:
        ids = np.random.default_rng(i).integers(0, cfg.vocab_size, req.num_tokens)  # content does not route here
    recorded = req.token_ids_T.tolist() if req.token_ids_T is not None else req.tokens
    return ReplayRequest(i, req.name, [int(x) for x in ids[:prompt]], req.num_tokens - prompt, req.ids_TLK,
                         req.weights_TLK, recorded if recorded and len(recorded) == req.num_tokens else None)


class RouteReplayer:
    """The models' RoutingSource during a replay, and a pass hook of the engine: `requests[request id]` is the
    recorded request that engine request replays."""

    def __init__(self, requests: dict[int, ReplayRequest], moe_layers: Sequence[int], device: torch.device):
        self.column = {layer: i for i, layer in enumerate(moe_layers)}
        self._ids = {rid: torch.from_numpy(r.ids_TLK.astype(np.int64)).to(device) for rid, r in requests.items()}
        self._weights = {rid: None if r.weights_TLK is None else torch.from_numpy(r.weights_TLK.astype(np.float32))
                         .to(device) for rid, r in requests.items()}
        self._has_missing = {rid: bool((r.ids_TLK == MISSING).any()) for rid, r in requests.items()}
        self._tokens = {rid: r.tokens for rid, r in requests.items()}
        self._ids_NLK: torch.Tensor | None = None
        self._weights_NLK: torch.Tensor | None = None
        self._next_NLK: torch.Tensor | None = None
        self._pass: PassInfo | None = None
        self._missing = False

    def begin_pass(self, info: PassInfo) -> None:
        """The next pass carries `counts[i]` tokens of request `requests[i]` from position `starts[i]`: their
        recorded routing comes next."""
        ids, weights = [], []
        for rid, start, n in zip(info.requests, info.starts, info.counts, strict=True):
            if start + n > len(self._ids[rid]):
                raise RuntimeError(f"routing replay: request {rid} ran past its {len(self._ids[rid])} recorded tokens")
            ids.append(self._ids[rid][start:start + n])
            w = self._weights[rid]
            weights.append(None if w is None else w[start:start + n])
        self._ids_NLK = ids[0] if len(ids) == 1 else torch.cat(ids)
        self._pass, self._next_NLK = info, None
        self._weights_NLK = None if any(w is None for w in weights) else (
            weights[0] if len(weights) == 1 else torch.cat(weights))  # type: ignore[arg-type]
        self._missing = any(self._has_missing[r] for r in info.requests)

    def recorded(self, column: int, ahead: int) -> torch.Tensor:
        """ids_NK the trace recorded at MoE layer `column` (its position among the MoE layers) for this pass's
        tokens (`ahead` 0) or for the token after each of them (`ahead` 1; MISSING after a request's last one):
        what the `replay-oracle` predictor forecasts, a perfect predictor's upper bound."""
        assert self._ids_NLK is not None and self._pass is not None, "begin_pass must announce a pass first"
        if not ahead:
            return self._ids_NLK[:, column]
        if self._next_NLK is None:  # made once per pass, and only when asked: plain replays never are
            following = []
            for rid, start, n in zip(self._pass.requests, self._pass.starts, self._pass.counts):
                after = self._ids[rid][start + 1:start + n + 1]
                if len(after) < n:  # the request's last recorded token: nothing follows it
                    after = torch.cat((after, torch.full_like(self._ids[rid][:1], MISSING)))
                following.append(after)
            self._next_NLK = following[0] if len(following) == 1 else torch.cat(following)
        return self._next_NLK[:, column]

    def recorded_tokens(self) -> list[str] | list[int] | None:
        """The trace's tokens at this pass's positions, rows in order (None when a row's request has none): what
        the recorded model read there, so a predictor keyed on tokens sees what it was fitted on."""
        assert self._pass is not None, "begin_pass must announce a pass first"
        out: list = []
        for rid, start, n in zip(self._pass.requests, self._pass.starts, self._pass.counts, strict=True):
            tokens = self._tokens[rid]
            if tokens is None:
                return None
            out += tokens[start:start + n]
        return out

    def recorded_token(self, request: int, position: int) -> str | int | None:
        """The trace's token of one request at one position (None where the request has none, or past its end)."""
        tokens = self._tokens.get(request)
        return tokens[position] if tokens is not None and position < len(tokens) else None

    def route(self, layer: int, gate: nn.Module, x_ND: torch.Tensor) -> RoutingDecision:
        own: RoutingDecision = gate(x_ND)
        assert self._ids_NLK is not None, "begin_pass must announce a pass before the model runs"
        column = self.column[layer]
        ids_NK = self._ids_NLK[:, column]
        if self._weights_NLK is not None:
            weights_NK = self._weights_NLK[:, column].to(own.weights_TK.dtype)
        else:
            weights_NK = renormalised(own, ids_NK)
        if self._missing:
            keep_N1 = (ids_NK == MISSING).any(1, keepdim=True)
            ids_NK = torch.where(keep_N1, own.ids_TK, ids_NK)
            weights_NK = torch.where(keep_N1, own.weights_TK, weights_NK)
        return RoutingDecision(ids_NK, weights_NK, own.scores_TE)


def renormalised(own: RoutingDecision, ids_NK: torch.Tensor) -> torch.Tensor:
    """The router's scores at `ids_NK`, scaled to the total weight it gave its own top-k (uniform where the
    scores there are all zero, e.g. experts outside DeepSeek's selected groups)."""
    scores_NK = own.scores_TE.float().gather(1, ids_NK.clamp_min(0))
    total_N1 = own.weights_TK.float().sum(1, keepdim=True)
    mass_N1 = scores_NK.sum(1, keepdim=True)
    share_NK = torch.where(mass_N1 > 0, scores_NK / mass_N1.clamp_min(torch.finfo(torch.float32).tiny),
                           torch.full_like(scores_NK, 1.0 / ids_NK.shape[1]))
    return (share_NK * total_N1).to(own.weights_TK.dtype)


@dataclass
class ReplayReport:
    """The replay's section of RunStats: which trace and requests drove the routing."""

    trace: str
    requests: list[int]
    prompt_tokens: int | None

    def to_dict(self) -> dict[str, object]:
        return {"trace": self.trace, "requests": self.requests, "prompt_tokens": self.prompt_tokens}

    def rows(self) -> list[tuple[str, str]]:
        lo, hi = min(self.requests), max(self.requests)
        which = f"{lo}:{hi + 1}" if len(self.requests) == hi - lo + 1 else ",".join(map(str, self.requests))
        prompt = "" if self.prompt_tokens is None else f", first {self.prompt_tokens} tokens as the prompt"
        return [("routing", f"replayed from {self.trace}, requests {which}{prompt}")]
