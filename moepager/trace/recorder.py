"""The engine's trace recorder: every MoE block reports its routing; each pass is split into its requests.

Wiring (runtime/llm.py): `model.observe_routing(recorder)` makes every MoE block call `routed(layer, x, route)`;
the generation loop calls `begin_pass(phase, rows, counts, token_ids)` before each forward pass, saying which
prompt rows its tokens belong to (MoE blocks see the valid tokens row-major: row 0's, then row 1's ...).
`write` turns what was seen into trace format v1, one request per prompt, with full gate distributions (and,
with `hidden=True`, every router input: what token-wise predictors train on). Runs that do not record use the
models' null observer, so the hot path has no branch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from moepager.outputs import atomic_file
from moepager.trace.format import DECODE, PREFILL, TraceHeader, TraceRequest, TraceWriter
from moepager.types import Phase, RoutingDecision


class TraceRecorder:
    def __init__(self, header: TraceHeader, num_rows: int, hidden: bool = False):
        self.header = header
        self.hidden = hidden
        self._column = {layer: i for i, layer in enumerate(header.moe_layers)}
        self._rows: list[dict[str, list[np.ndarray]]] = [
            {"ids": [], "weights": [], "gates": [], "phase": [], "hidden": []} for _ in range(num_rows)]
        self._layout: tuple[Phase, Sequence[int], Sequence[int]] | None = None
        self._pass: dict[int, RoutingDecision] = {}
        self._hidden: dict[int, torch.Tensor] = {}

    def begin_pass(self, phase: Phase, rows: Sequence[int], counts: Sequence[int],
                   token_ids_N: torch.Tensor | None = None) -> None:
        """The next forward pass carries `counts[i]` tokens of prompt row `rows[i]`, in that order."""
        self._flush()
        self._layout = (phase, list(rows), list(counts))

    def routed(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> None:
        self._pass[self._column[layer]] = RoutingDecision(*(t.detach().to("cpu") for t in route))
        if self.hidden:
            self._hidden[self._column[layer]] = x_ND.detach().to("cpu", torch.float16)

    def _flush(self) -> None:
        if self._layout is None or not self._pass:
            return
        phase, rows, counts = self._layout
        num_layers = self.header.num_layers
        if len(self._pass) != num_layers:
            raise RuntimeError(f"trace recorder: a pass routed {len(self._pass)} of {num_layers} MoE layers")
        ids = torch.stack([self._pass[i].ids_TK for i in range(num_layers)], 1).numpy()
        weights = torch.stack([self._pass[i].weights_TK.float() for i in range(num_layers)], 1).numpy()
        gates = torch.stack([self._pass[i].scores_TE.float() for i in range(num_layers)], 1).numpy()
        hidden = torch.stack([self._hidden[i] for i in range(num_layers)], 1).numpy() if self.hidden else None
        start = 0
        for row, n in zip(rows, counts, strict=True):
            buf = self._rows[row]
            buf["ids"].append(ids[start:start + n])
            buf["weights"].append(weights[start:start + n])
            buf["gates"].append(gates[start:start + n])
            buf["phase"].append(np.full(n, PREFILL if phase == "prefill" else DECODE, np.uint8))
            if hidden is not None:
                buf["hidden"].append(hidden[start:start + n])
            start += n
        self._pass, self._hidden, self._layout = {}, {}, None

    def write(self, path: str | Path, token_ids: Sequence[Sequence[int]], prompts: Sequence[str | None],
              detokenize: Callable[[list[int]], str] | None = None) -> None:
        """`token_ids[row]` are the tokens the model was fed for that row (prompt, then generated ones)."""
        self._flush()
        with atomic_file(path) as partial, TraceWriter(partial, self.header) as writer:
            for row, buf in enumerate(self._rows):
                phase = np.concatenate(buf["phase"])
                fed = list(token_ids[row])[: len(phase)]
                writer.add(TraceRequest(
                    ids_TLK=np.concatenate(buf["ids"]).astype(np.int16), phase_T=phase,
                    weights_TLK=np.concatenate(buf["weights"]), gates_TLE=np.concatenate(buf["gates"]),
                    hidden_TLD=np.concatenate(buf["hidden"]) if buf["hidden"] else None,
                    token_ids_T=np.array(fed, np.int64), prompt=prompts[row], name=f"request{row}",
                    tokens=[detokenize([t]) for t in fed] if detokenize is not None else None))
