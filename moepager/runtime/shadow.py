"""OD-MoE's shadow (SEP, §2.5): a quantized copy of the model on a rank of its own that computes every pass the main
rank computes, as soon as the main rank announces it, and sends each MoE layer's routing to the workers that hold
those experts as forecasts to load ahead. Its int8 copy (int8 experts and dense projections) has no experts to wait
for, so it reaches a layer before the main rank does, whose workers are still computing earlier layers.

Alignment: the main rank sends each pass's rows (request, start, count) and token ids before its own forward
(`ShadowFeed`, a pass part), so the shadow feeds the main rank's tokens at the main rank's positions into a KV cache of
its own (the alignment period is one pass: the shadow never runs on tokens of its own). A request's cache blocks
are taken back when the pool needs them for the pass at hand (the shadow is not told when requests finish), oldest
pass first; a request whose blocks were taken is computed again from its first token the next time it appears.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from moepager.config import EngineConfig
from moepager.experts.remote import HEADER, STATS, STOP, Placement, message, send_forecasts
from moepager.runtime.builder import build
from moepager.runtime.kv_pool import KVBlockPool
from moepager.runtime.runner import ModelRunner
from moepager.runtime.scheduler import Scheduled
from moepager.types import PassInfo, RoutingDecision

SHADOW_RANK = 1
PASS = 4
"""The main rank's pass announcement to the shadow: rows, then token ids."""


class ShadowFeed:
    """On the main rank: each pass's rows and tokens to the shadow rank before the pass runs (a pass part)."""

    def begin_pass(self, info: PassInfo) -> None:
        rows = torch.tensor([[r, s, c, phase == "decode"] for r, s, c, phase in
                             zip(info.requests, info.starts, info.counts, info.row_phases)])
        dist.send(message(PASS, len(info.requests), len(info.token_ids_N), pass_id=info.pass_id), SHADOW_RANK)
        dist.send(rows, SHADOW_RANK)
        dist.send(info.token_ids_N.to(torch.long).contiguous(), SHADOW_RANK)


@dataclass
class _Request:
    """What the runner reads of a request: its tokens so far and its cache blocks."""

    request_id: int
    ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    last_pass: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def tokens(self, start: int, count: int) -> list[int]:
        return self.ids[start:start + count]


class Shadow:
    """The shadow rank: the model's int8 copy computing the main rank's passes, its routing sent to the workers."""

    def __init__(self, config: EngineConfig, path: Path, placement: Placement):
        quantized = EngineConfig(model=config.model, dtype=config.dtype, threads=config.threads, expert_dtype="int8",
                                 dense_dtype="int8", scheduler=config.scheduler)
        loaded = build(quantized, path, False).loaded
        self.model, self.placement = loaded.model, placement
        scheduler = config.scheduler
        self.pool = KVBlockPool(self.model, loaded.dtype, loaded.device, scheduler.kv_cache_tokens,
                                scheduler.block_size)
        self.runner = ModelRunner(self.model, self.pool, loaded.device)
        self.position = {layer: i for i, layer in enumerate(self.model.config.moe_layers)}
        self.model.observe_routing(self)
        self.requests: dict[int, _Request] = {}
        self.pass_id = 0
        self.passes = 0

    # -- the routing observer: each layer's top-k, to the workers that hold those experts -----------------------
    def stage(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> Sequence[torch.Tensor]:
        return ()

    def routed(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision, staged: Sequence[torch.Tensor]) -> None:
        assert route.ids_host_TK is not None
        position = self.position[layer]
        experts = sorted(set(route.ids_host_TK.flatten().tolist()))
        send_forecasts(self.placement, [(position, e) for e in experts], self.pass_id)

    # -- the loop -----------------------------------------------------------------------------------------------
    def serve(self) -> int:
        """Compute each pass the main rank announces until it says stop; returns the passes computed."""
        header = torch.empty(HEADER, dtype=torch.long)
        while True:
            dist.recv(header, 0)
            op, num_rows, num_tokens, *_, pass_id = header.tolist()
            if op == STOP:
                dist.send(torch.zeros(len(STATS), dtype=torch.float64), 0)  # a worker's counters: none here
                return self.passes
            assert op == PASS, f"the shadow rank got message {op}"
            rows = torch.empty(num_rows, 4, dtype=torch.long)
            ids = torch.empty(num_tokens, dtype=torch.long)
            dist.recv(rows, 0)
            dist.recv(ids, 0)
            self.pass_id = pass_id
            self._run(rows.tolist(), ids.tolist())
            self.passes += 1

    def _run(self, rows: list[list[int]], ids: list[int]) -> None:
        """The pass's rows: each request's tokens so far updated, and what its cache lacks computed (its whole
        prefix again when its blocks were taken back)."""
        scheduled, offset = [], 0
        for request_id, start, count, decoding in rows:
            request = self.requests.setdefault(request_id, _Request(request_id))
            del request.ids[start:]
            request.ids += ids[offset:offset + count]
            offset += count
            request.last_pass = self.pass_id
            begin = min(request.num_computed, start)
            if self._reserve(request, start + count):
                scheduled.append(Scheduled(request, begin, start + count - begin,  # type: ignore[arg-type]
                                           bool(decoding) and begin == start))
        if scheduled:
            self.runner.run(scheduled)

    def _reserve(self, request: _Request, tokens: int) -> bool:
        """Cache blocks for `tokens` positions, taking back the blocks of requests least recently seen."""
        while not self.pool.reserve(request.blocks, tokens):
            others = [r for r in self.requests.values() if r.blocks and r.last_pass < self.pass_id]
            if not others:
                return False
            oldest = min(others, key=lambda r: r.last_pass)
            self.pool.release(oldest.blocks)
            oldest.num_computed = 0
        return True
