"""OD-MoE's shadow (SEP, §2.5): a quantized copy of the model on a rank of its own that computes every pass the main
rank computes, as soon as the main rank announces it, and sends each MoE layer's routing to the workers that hold
those experts as forecasts to load ahead. Its int8 copy (int8 experts and dense projections) has no experts to wait
for, so it reaches a layer before the main rank does, whose workers are still computing earlier layers.

Alignment: the main rank sends each pass's rows (request, start, count) and token ids before its own forward
(experts/remote/feed.py `ShadowFeed`, a pass part), so the shadow feeds the main rank's tokens at the main rank's
positions into a KV cache of its own. With `--align-period P` > 1 it also runs ahead: after a pass it was told of, it
guesses each row's next token (its own greedy choice) and computes the passes after it on those guesses, up to P - 1
passes ahead of the main rank, sending their routing as forecasts for those later passes (a worker keeps a forecast
until the layer call of its pass comes). Each pass it is told of realigns it: the main rank's tokens are compared with
its guesses, and from the first that differs its cache is computed again (a right guess costs nothing more: its tokens
are in the cache). A request's cache blocks are taken back when the pool needs them for a pass it was told of (the
shadow is not told when requests finish), oldest pass first, never those of the pass at hand; a request whose blocks
were taken is computed again from its first token the next time it appears. KV alignment (`--kv-align-period K`; default
0, off: config.py says why): with every K-th pass announced, the main rank sends its own full-precision KV entries
(every layer) of the positions it computed since it last sent that request's, and they overwrite the shadow's
int8-computed ones before it computes the pass (experts/remote/kv_align.py), so its cache drifts no further than K
passes.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from moepager.config import EngineConfig, ExpertFormat
from moepager.errors import MoepagerError
from moepager.experts.remote.kv_align import entry_sizes, slots, write
from moepager.experts.remote.placement import Links, Placement, recv_placement
from moepager.experts.remote.protocol import STATS, Pass, Place, Stop, receive, send, send_forecasts
from moepager.runtime.builder import build
from moepager.runtime.kv_pool import KVBlockPool
from moepager.runtime.runner import ModelRunner
from moepager.runtime.sampling import greedy_picks
from moepager.runtime.scheduler import Scheduled
from moepager.types import Phase, RoutingDecision


@dataclass
class ShadowRequest:
    """What the runner reads of a request: its tokens so far and its cache blocks."""

    request_id: int
    ids: list[int] = field(default_factory=list)
    """Its tokens: those the main rank sent, then the shadow's guesses of the next ones."""
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    last_pass: int = 0
    told: int = 0
    """How many of `ids` the main rank sent (the rest are guesses)."""
    guess: int | None = None
    """The shadow's greedy choice of the token after `ids` (from the logits of its last computed token)."""

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def tokens(self, start: int, count: int) -> list[int]:
        return self.ids[start:start + count]


class Shadow:
    """The shadow rank: the model's int8 copy computing the main rank's passes, and up to `align_period - 1` passes
    ahead of them on its own guesses, its routing sent to the workers."""

    def __init__(self, config: EngineConfig, path: Path, placement: Placement, links: Links = Links()):
        quantized = EngineConfig(model=config.model, dtype=config.dtype, threads=config.threads,
                                 experts=ExpertFormat("int8"), dense_dtype="int8", scheduler=config.scheduler)
        loaded = build(quantized, path, False).loaded
        self.model, self.placement, self.links = loaded.model, placement, links
        self.timeout = datetime.timedelta(seconds=config.remote.worker_timeout_s)
        scheduler = config.scheduler
        self.pool = KVBlockPool(self.model, loaded.dtype, loaded.device, scheduler.kv_cache_tokens,
                                scheduler.block_size)
        self.runner = ModelRunner(self.model, self.pool, loaded.device)
        self.position = {layer: i for i, layer in enumerate(self.model.config.moe_layers)}
        self.model.observe_routing(self)
        self.requests: dict[int, ShadowRequest] = {}
        self.pass_id = 0
        self.passes = 0
        self.ahead = config.remote.align_period - 1
        """Passes it may run ahead of the main rank on its own guesses."""
        self.told = 0
        """The latest pass the main rank told of: passes run ahead never take back its requests' cache blocks."""
        self.guessed = self.right = self.passes_ahead = 0
        """Tokens guessed that the main rank then sent, those guessed right, and passes computed ahead."""
        self.aligned = 0
        """Positions of its cache the main rank's KV entries overwrote (KV alignment)."""
        self.phase: Phase = "prefill"
        """The phase of the main rank's pass it computes (its forecasts go to the workers that pass's calls reach)."""

    # -- the routing observer: each layer's top-k, to the workers that hold those experts -----------------------
    def stage(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> Sequence[torch.Tensor]:
        return ()

    def routed(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision, staged: Sequence[torch.Tensor]) -> None:
        assert route.ids_host_TK is not None
        position = self.position[layer]
        experts = sorted(set(route.ids_host_TK.flatten().tolist()))
        send_forecasts(partial(self.placement.ranks_of, phase=self.phase), [(position, e) for e in experts],
                       self.pass_id, self.links.forecasts_of)

    # -- the loop -----------------------------------------------------------------------------------------------
    def serve(self) -> int:
        """Compute each pass the main rank announces (and the passes after it, on guesses, up to `ahead`) until it
        says stop, then answer with its counters (`stats`); returns the passes computed."""
        while True:
            message = receive(0)  # a server may sit idle for hours
            if isinstance(message, Stop):
                self._stop_forecasts()
                dist.send(self.stats(), 0)
                return self.passes
            if isinstance(message, Place):  # a worker was lost: forecasts go by the placement left
                self.placement = recv_placement(message)
                continue
            if not isinstance(message, Pass):
                raise MoepagerError(f"the shadow rank got a {type(message).__name__} message, which workers take")
            rows = torch.empty(message.rows, 4, dtype=torch.long)
            ids = torch.empty(message.tokens, dtype=torch.long)
            dist.recv(rows, 0)
            dist.recv(ids, 0)
            if message.kv_tokens:  # KV alignment: the main rank's entries of positions it computed since
                spans = torch.empty(message.kv_rows, 3, dtype=torch.long)
                entries = torch.empty(message.kv_tokens, sum(entry_sizes(self.pool.cache)), dtype=message.kv_dtype)
                dist.recv(spans, 0)
                dist.recv(entries, 0)
                self.align(spans.tolist(), entries)
            pass_id, listed = message.pass_id, rows.tolist()
            self.pass_id = self.told = pass_id
            self.phase = "decode" if all(row[3] for row in listed) else "prefill"  # the main rank's
            told = self._run(listed, ids.tolist())
            self.passes += 1
            for step in range(1, self.ahead + 1):
                self._run_ahead(told, pass_id + step)

    def _stop_forecasts(self) -> None:
        """Each worker's thread that takes the forecasts (experts/remote/worker.py `ExpertWorker`) is told to
        stop; a worker lost is skipped."""
        for rank in self.placement.ranks:
            try:
                send(Stop(), [], rank, self.links.forecasts_of(rank), self.timeout)
            except RuntimeError:
                pass

    def stats(self) -> torch.Tensor:
        """The counters a worker answers a stop with (`STATS`), as the shadow's: calls = passes it was told of,
        loads_ahead = passes it computed ahead, hits / misses = its guesses the main rank's tokens confirmed / not,
        aligned = positions of its cache the main rank's KV entries overwrote."""
        values = dict.fromkeys(STATS, 0.0) | {"calls": self.passes, "loads_ahead": self.passes_ahead,
                                               "hits": self.right, "misses": self.guessed - self.right,
                                               "aligned": self.aligned}
        return torch.tensor([values[name] for name in STATS], dtype=torch.float64)

    def align(self, spans: Sequence[Sequence[int]], entries_PX: torch.Tensor) -> None:
        """OD-MoE's KV alignment (experts/remote/kv_align.py): the main rank's entries (every layer, its dtype)
        written over this cache's at each span (request, start, count) it still holds computed; a span of a request
        whose blocks were taken back is skipped (computed again from its first token, it is aligned at a later
        pass)."""
        bs, index, rows, offset = self.pool.block_size, [], [], 0
        for request_id, start, count in spans:
            request = self.requests.get(request_id)
            if request is not None and request.num_computed >= start + count:
                index.append(slots(request.blocks, start, count, bs))
                rows.append(torch.arange(offset, offset + count))
            offset += count
        if index:
            write(self.pool.cache, torch.cat(index), entries_PX[torch.cat(rows)])
            self.aligned += sum(len(i) for i in index)

    def _run(self, rows: list[list[int]], ids: list[int]) -> list[ShadowRequest]:
        """The pass's rows: each request's tokens so far updated against what it guessed, and what its cache lacks
        computed (from the first wrong guess; its whole prefix again when its blocks were taken back). Returns the
        decoding requests, whose next tokens the shadow may guess."""
        scheduled, offset, told = [], 0, []
        for request_id, start, count, decoding in rows:
            request = self.requests.setdefault(request_id, ShadowRequest(request_id))
            assert start <= len(request.ids), "the main rank sends every position of a request in order"
            sent = ids[offset:offset + count]
            offset += count
            known = request.ids[start:]
            agree = next((i for i, (a, b) in enumerate(zip(known, sent)) if a != b), min(len(known), len(sent)))
            guessed = max(0, min(len(request.ids), start + count) - max(start, request.told))  # its guesses sent
            self.guessed += guessed
            self.right += max(0, min(start + agree - max(start, request.told), guessed))
            if agree < min(len(known), len(sent)):  # a wrong guess: it and every token after it go
                del request.ids[start + agree:]
                request.num_computed = min(request.num_computed, start + agree)
                request.guess = None
            request.ids += sent[len(request.ids) - start:]
            request.told = start + count
            request.last_pass = self.pass_id
            begin = min(request.num_computed, start + count)
            if begin < start + count:  # computed again or for the first time: guesses past it are not in the cache
                del request.ids[start + count:]
                request.guess = None
                if self._reserve(request, start + count):
                    scheduled.append(Scheduled(request, begin, start + count - begin,
                                               bool(decoding) and begin == start))
            if decoding:
                told.append(request)
        self._compute(scheduled)
        return told

    def _run_ahead(self, requests: list[ShadowRequest], pass_id: int) -> None:
        """The pass `pass_id` on guesses: each request not yet guessed that far takes its guessed token, computed
        with its routing sent as forecasts for that pass."""
        scheduled = []
        for request in requests:
            if len(request.ids) - request.told >= pass_id - self.told or request.guess is None:
                continue  # guessed that far already, or nothing to guess from
            request.ids.append(request.guess)
            request.guess = None
            if self._reserve(request, len(request.ids)):
                scheduled.append(Scheduled(request, len(request.ids) - 1, 1, True))
            else:
                request.ids.pop()
        if scheduled:
            self.pass_id, self.phase = pass_id, "decode"
            self._compute(scheduled)
            self.passes_ahead += 1

    def _compute(self, scheduled: list[Scheduled]) -> None:
        """Run the rows (their routing goes out as this pass's forecasts) and keep each finished row's guess of its
        next token."""
        for row, logits in self.runner.run(scheduled) if scheduled else ():  # the sampler's greedy pick
            self.requests[row.request.request_id].guess = greedy_picks(logits.view(1, -1))[0][0]

    def _reserve(self, request: ShadowRequest, tokens: int) -> bool:
        """Cache blocks for `tokens` positions, taking back the blocks of requests least recently told of (never
        those of the pass the main rank told of last)."""
        while not self.pool.reserve(request.blocks, tokens):
            others = [r for r in self.requests.values() if r.blocks and r.last_pass < self.told]
            if not others:
                return False
            oldest = min(others, key=lambda r: r.last_pass)
            self.pool.release(oldest.blocks)
            oldest.num_computed = 0
            oldest.guess = None
        return True
