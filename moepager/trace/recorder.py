"""The engine's trace recorder: every MoE block reports its routing; each pass is split into its requests.

Wiring (runtime/llm.py): `model.observe_routing(recorder)` makes every MoE block call `stage` and `routed`
(models/routing.py); the engine's runner calls `begin_pass(info)` before each forward pass, saying which requests
its tokens belong to and at which positions (MoE blocks see the valid tokens row-major: row 0's, then row 1's
...); a request that was preempted computes its tokens again, and the recomputed tokens replace what was recorded
from that position on. `write` turns what was seen into trace format v1, one request per prompt, with full gate
distributions (and, with `hidden=True`, every router input: what token-wise predictors train on); a token is a
prefill token when it lies in its request's prompt. Runs that do not record use the
models' null observer, so the hot path has no branch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from moepager.atomic_io import atomic_file
from moepager.trace.format import DECODE, PREFILL, TraceHeader, TraceRequest, TraceWriter
from moepager.types import PassInfo, RoutingDecision

FIELDS = ("ids", "weights", "gates", "hidden")


class TraceRecorder:
    def __init__(self, header: TraceHeader, hidden: bool = False):
        self.header = header
        self.hidden = hidden
        self._column = {layer: i for i, layer in enumerate(header.moe_layers)}
        self._requests: dict[int, dict[str, list[np.ndarray]]] = {}
        self._seen: dict[int, int] = {}
        """Tokens recorded of each request."""
        self._layout: PassInfo | None = None
        self._pass: dict[int, RoutingDecision] = {}
        self._hidden: dict[int, torch.Tensor] = {}

    def begin_pass(self, info: PassInfo) -> None:
        self._flush()
        self._layout = info

    def stage(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> Sequence[torch.Tensor]:
        """The weights, the scores and (recording hidden states) the router's input in float16, copied to the host
        with the ids."""
        staged = [route.weights_TK.detach(), route.scores_TE.detach()]
        return staged + [x_ND.detach().to(torch.float16)] if self.hidden else staged

    def routed(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision, staged: Sequence[torch.Tensor]) -> None:
        column = self._column[layer]
        self._pass[column] = RoutingDecision(route.ids_host_TK, staged[0], staged[1])
        if self.hidden:
            self._hidden[column] = staged[2]

    def _flush(self) -> None:
        if self._layout is None or not self._pass:
            return
        info, num_layers = self._layout, self.header.num_layers
        if len(self._pass) != num_layers:
            raise RuntimeError(f"trace recorder: a pass routed {len(self._pass)} of {num_layers} MoE layers")
        columns = {"ids": torch.stack([self._pass[i].ids_TK for i in range(num_layers)], 1).numpy(),
                   "weights": torch.stack([self._pass[i].weights_TK.float() for i in range(num_layers)], 1).numpy(),
                   "gates": torch.stack([self._pass[i].scores_TE.float() for i in range(num_layers)], 1).numpy()}
        if self.hidden:
            columns["hidden"] = torch.stack([self._hidden[i] for i in range(num_layers)], 1).numpy()
        offset = 0
        for request, start, n in zip(info.requests, info.starts, info.counts, strict=True):
            buf = self._requests.setdefault(request, {f: [] for f in FIELDS})
            if start < self._seen.get(request, 0):  # preempted: the recomputed tokens replace the recorded ones
                for f, chunks in buf.items():
                    buf[f] = [np.concatenate(chunks)[:start]] if chunks else []
            for f, values in columns.items():
                buf[f].append(values[offset:offset + n])
            self._seen[request] = start + n
            offset += n
        self._pass, self._hidden, self._layout = {}, {}, None

    def write(self, path: str | Path, requests: Sequence[RecordedRequest],
              detokenize: Callable[[list[int]], str] | None = None) -> None:
        """One trace request per `requests` entry, in that order."""
        self._flush()
        with atomic_file(path) as partial, TraceWriter(partial, self.header) as writer:
            for i, r in enumerate(requests):
                buf = self._requests[r.request_id]
                fed = (list(r.prompt_ids) + list(r.out_ids))[: self._seen[r.request_id]]
                phase = np.where(np.arange(len(fed)) < len(r.prompt_ids), PREFILL, DECODE).astype(np.uint8)
                writer.add(TraceRequest(
                    ids_TLK=np.concatenate(buf["ids"]).astype(np.int16), phase_T=phase,
                    weights_TLK=np.concatenate(buf["weights"]), gates_TLE=np.concatenate(buf["gates"]),
                    hidden_TLD=np.concatenate(buf["hidden"]) if buf["hidden"] else None,
                    token_ids_T=np.array(fed, np.int64), prompt=r.prompt, name=f"request{i}",
                    tokens=[detokenize([t]) for t in fed] if detokenize is not None else None))


class RecordedRequest(NamedTuple):
    request_id: int
    prompt_ids: Sequence[int]
    out_ids: Sequence[int]
    prompt: str | None
