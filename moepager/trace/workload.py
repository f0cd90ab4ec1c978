"""A trace flattened for replay: all requests' routing in one array, and the steps (forward passes) to replay.

Orders: `decode` replays every token as its own step (a prompt recorded in one pass is a valid decode-order
trace: with a KV cache a token's routing depends only on earlier tokens); `recorded` keeps each request's
prefill tokens together as one step, as the engine runs them. With `batch` > 1, requests are interleaved as
a continuously batched decode: each step takes the next token of up to `batch` active requests (a request's
prefill, in `recorded` order, is a step of its own when it joins).
Shape legend: N tokens of all requests, S steps, L traced MoE layers, K top-k, E experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from moepager.policies.base import NEVER
from moepager.trace.format import DECODE, MISSING, PREFILL, TraceError, TraceHeader, TraceReader, TraceRequest

Order = Literal["decode", "recorded"]


@dataclass
class Workload:
    header: TraceHeader
    ids_NLK: np.ndarray
    """int16 expert ids; MISSING entries were not recorded and are not replayed."""
    phase_N: np.ndarray
    request_N: np.ndarray
    """Which request each token belongs to."""
    step_tokens: np.ndarray
    """Token indices in replay order; step s is step_tokens[step_ptr[s]:step_ptr[s+1]]."""
    step_ptr: np.ndarray
    step_phase: np.ndarray
    """0 prefill / 1 decode per step (every step is decode in `decode` order)."""
    names: list[str]

    @property
    def num_steps(self) -> int:
        return len(self.step_ptr) - 1

    def step_kv(self) -> np.ndarray:
        """Each step's KV length: positions of its request up to and including the step (the longest row's)."""
        starts = np.concatenate([[0], np.cumsum(np.bincount(self.request_N))[:-1]])
        pos_N = np.arange(len(self.request_N)) - starts[self.request_N]
        return np.maximum.reduceat(pos_N[self.step_tokens], self.step_ptr[:-1]) + 1

    def next_use_NLK(self) -> np.ndarray:
        """For every access, the next step that requests the same (layer, expert); NEVER if none (Belady)."""
        n, num_layers, k = self.ids_NLK.shape
        e = self.header.num_experts
        step_of = np.empty(n, np.int64)
        step_of[self.step_tokens] = np.repeat(np.arange(self.num_steps), np.diff(self.step_ptr))
        key = (np.arange(num_layers)[None, :, None] * e + self.ids_NLK).astype(np.int64)
        combo = key * self.num_steps + step_of[:, None, None]
        valid = self.ids_NLK != MISSING
        unique, inverse = np.unique(combo[valid], return_inverse=True)
        following = np.full(len(unique), NEVER, np.int64)
        same_key = unique[1:] // self.num_steps == unique[:-1] // self.num_steps
        following[:-1][same_key] = unique[1:][same_key] % self.num_steps
        out = np.full(self.ids_NLK.shape, NEVER, np.int64)
        out[valid] = following[inverse]
        return out

    def requested_SL(self) -> np.ndarray:
        """Distinct experts each step routes to in each layer (what a cacheless deployment loads: OD-MoE)."""
        return self.routed_SLE().sum(2)

    def routed_SLE(self) -> np.ndarray:
        """Whether each step routes to each expert of each layer, [steps, layers, experts] bool."""
        num_layers, e = self.header.num_layers, self.header.num_experts
        step_of = np.repeat(np.arange(self.num_steps), np.diff(self.step_ptr))
        ids = self.ids_NLK[self.step_tokens].astype(np.int64)  # [N, L, K] in step order
        valid = ids != MISSING
        layer = np.broadcast_to(np.arange(num_layers)[None, :, None], ids.shape)
        step = np.broadcast_to(step_of[:, None, None], ids.shape)
        seen = np.zeros((self.num_steps, num_layers, e), bool)
        seen[step[valid], layer[valid], ids[valid]] = True
        return seen

    def counts_LE(self) -> np.ndarray:
        """How often each expert was chosen (a frequency prior)."""
        num_layers, e = self.header.num_layers, self.header.num_experts
        valid = self.ids_NLK != MISSING
        layer = np.broadcast_to(np.arange(num_layers)[None, :, None], self.ids_NLK.shape)
        return np.bincount((layer * e + self.ids_NLK)[valid].astype(np.int64),
                           minlength=num_layers * e).reshape(num_layers, e).astype(np.float64)


@dataclass(frozen=True)
class Cut:
    """How a replay reads each request (the engine's routing replay and the simulator read it alike)."""

    prompt_tokens: int | None = None
    """The first N tokens are the prompt (prefill), every later one a decode step; None: recorded phases."""
    decode_steps: int | None = None
    """Decode steps kept per request (each must have that many); None: all."""
    layers: int | None = None
    """Keep the first N MoE layers; None: all."""

    def apply(self, req: TraceRequest, index: int) -> TraceRequest:
        """`req` as replayed: phases re-cut, tokens and layers truncated; a clear error when it is too short."""
        t = req.num_tokens
        where = f"trace request {index} ('{req.name}', {t} tokens)"
        prompt = self.prompt_tokens
        if prompt is None:
            prompt = int((req.phase_T == PREFILL).sum())
            if (req.phase_T[:prompt] != PREFILL).any():
                raise TraceError(f"{where}: its prefill tokens do not come first; say where prompts end with "
                                 f"--route-prompt N")
        elif prompt < 1:
            raise TraceError(f"the prompt must be at least 1 token, got {prompt}")
        steps = t - prompt if self.decode_steps is None else self.decode_steps
        if prompt > t or steps < 0 or prompt + steps > t:
            raise TraceError(f"{where} has fewer tokens than asked: {prompt} prompt tokens + {max(steps, 0)} "
                             f"decode steps")
        used, layers = prompt + steps, self.layers or req.ids_TLK.shape[1]
        phase = np.full(used, DECODE, np.uint8)
        phase[:prompt] = PREFILL

        def cut(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[:used, :layers]
        return replace(req, ids_TLK=req.ids_TLK[:used, :layers], phase_T=phase, weights_TLK=cut(req.weights_TLK),
                       gates_TLE=cut(req.gates_TLE), hidden_TLD=cut(req.hidden_TLD),
                       token_ids_T=None if req.token_ids_T is None else req.token_ids_T[:used],
                       tokens=None if req.tokens is None else req.tokens[:used])

    def header(self, header: TraceHeader) -> TraceHeader:
        if self.layers is None:
            return header
        if not 1 <= self.layers <= header.num_layers:
            raise TraceError(f"cannot keep {self.layers} MoE layers of a trace with {header.num_layers}")
        return replace(header, moe_layers=header.moe_layers[: self.layers])


def chosen_requests(requests: slice | Sequence[int] | None, total: int, path: object = "trace") -> list[int]:
    """Indices of the requests a slice or list picks out of `total`, refusing anything outside."""
    if total == 0:
        raise TraceError(f"{path}: no requests to replay (it may hold only priors)")
    if requests is None:
        return list(range(total))
    if isinstance(requests, slice):
        lo, hi = requests.start or 0, total if requests.stop is None else requests.stop
        if requests.step not in (None, 1) or lo < 0 or hi > total or lo >= hi:
            raise TraceError(f"request range {lo}:{hi} is outside the trace's {total} requests "
                             f"(choose a non-empty part of 0:{total})")
        return list(range(lo, hi))
    chosen = list(requests)
    bad = [i for i in chosen if not 0 <= i < total]
    if bad or not chosen:
        raise TraceError(f"request indices {bad or '[]'} are outside the trace's {total} requests")
    return chosen


def parse_requests(text: str) -> slice:
    """'A:B', 'A:', ':B' or 'A' -> a slice (end exclusive), as typed on the command line."""
    start, sep, stop = text.partition(":")
    try:
        if not sep:
            return slice(int(start), int(start) + 1)
        return slice(int(start) if start else None, int(stop) if stop else None)
    except ValueError:
        raise TraceError(f"requests must look like A:B (e.g. 0:8), got '{text}'") from None


def load_workload(path: str, order: Order = "decode", batch: int = 1,
                  requests: slice | Sequence[int] | None = None, cut: Cut | None = None,
                  chunk: int | None = None) -> Workload:
    """Read a trace file (optionally some of its requests, by slice or indices, cut as a replay reads them)
    and lay out its replay steps. `chunk` (order `recorded`): a prefill longer than that many tokens runs as
    steps of at most `chunk` tokens, as the engine's scheduler splits a prompt at --max-batched-tokens."""
    if batch < 1:
        raise TraceError(f"batch must be at least 1, got {batch}")
    if chunk is not None and chunk < 1:
        raise TraceError(f"a prefill chunk must be at least 1 token, got {chunk}")
    cut = cut or Cut()
    with TraceReader(path) as reader:
        chosen = chosen_requests(requests, len(reader), path)
        header = cut.header(reader.header)
        loaded = [reader.request(i) if cut == Cut() else cut.apply(reader.request(i), i) for i in chosen]
    ids = np.concatenate([r.ids_TLK for r in loaded])
    phase = np.concatenate([r.phase_T for r in loaded])
    lengths = np.array([r.num_tokens for r in loaded])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    request_N = np.repeat(np.arange(len(loaded)), lengths)
    names = [r.name for r in loaded]
    if order == "decode" and batch == 1:  # the common case, without per-token Python objects
        n = len(phase)
        return Workload(header, ids, phase, request_N, np.arange(n), np.arange(n + 1), np.full(n, DECODE, np.uint8),
                        names)
    units = [_units(int(s), r.phase_T, order, chunk) for s, r in zip(starts, loaded, strict=True)]
    steps, step_phase = _interleave(units, batch)
    ptr = np.concatenate([[0], np.cumsum([len(s) for s in steps])]).astype(np.int64)
    return Workload(header, ids, phase, request_N, np.concatenate(steps).astype(np.int64), ptr,
                    np.array(step_phase, np.uint8), names)


def _units(start: int, phase_T: np.ndarray, order: Order, chunk: int | None = None) -> list[tuple[np.ndarray, int]]:
    """A request's replay units: (token indices, phase); a `recorded` prefill is one unit, or units of at most
    `chunk` tokens."""
    t = len(phase_T)
    if order == "decode":
        return [(np.array([start + i]), DECODE) for i in range(t)]
    prefill = int((phase_T == PREFILL).sum())
    step = chunk or max(prefill, 1)
    head = [(np.arange(start + a, start + min(a + step, prefill)), PREFILL) for a in range(0, prefill, step)]
    return head + [(np.array([start + i]), DECODE) for i in range(prefill, t)]


def _interleave(units: list[list[tuple[np.ndarray, int]]], batch: int) -> tuple[list[np.ndarray], list[int]]:
    if batch == 1:
        flat = [u for request in units for u in request]
        return [u[0] for u in flat], [u[1] for u in flat]
    steps, phases = [], []
    waiting, active = list(range(len(units)))[::-1], []
    cursor = [0] * len(units)
    while waiting or active:
        while waiting and len(active) < batch:
            r = waiting.pop()
            active.append(r)
            while cursor[r] < len(units[r]) and units[r][cursor[r]][1] == PREFILL:  # a joining request's prefill
                steps.append(units[r][cursor[r]][0])                                # runs as passes of its own
                phases.append(PREFILL)
                cursor[r] += 1
        live = [r for r in active if cursor[r] < len(units[r])]
        if live:
            steps.append(np.concatenate([units[r][cursor[r]][0] for r in live]))
            phases.append(DECODE)
            for r in live:
                cursor[r] += 1
        active = [r for r in active if cursor[r] < len(units[r])]
    return steps, phases
