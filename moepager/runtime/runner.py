"""One forward pass over the scheduled tokens of many requests, each at its own position.

Rows are requests, right-padded to the longest row's token count (padding sits after each row's real tokens,
writes its keys and values to the scratch block, and is skipped by the MoE blocks). A step whose rows differ
so much in length that padding would more than double the tokens computed (prompt chunks beside one-token
decodes) runs as two passes, the decodes first: the dense layers compute every padded token.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from moepager.errors import NumericalError
from moepager.models.layers import CausalLM, ForwardBatch
from moepager.runtime.kv_pool import SCRATCH, KVBlockPool
from moepager.runtime.scheduler import Scheduled
from moepager.types import PassInfo, Phase

OnPass = Callable[[PassInfo], None]
"""Called before each forward pass (store, prefetcher, recorder, replayer)."""


def ignore_pass(info: PassInfo) -> None:
    """The `on_pass` of runs that neither page experts, record a trace nor prefetch."""


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVBlockPool, device: torch.device, on_pass: OnPass = ignore_pass):
        self.model, self.pool, self.device = model, pool, device
        self.on_pass = on_pass
        self.window = model.config.sliding_window
        self.passes = itertools.count()

    def run(self, rows: Sequence[Scheduled]) -> list[tuple[Scheduled, torch.Tensor]]:
        """Compute the rows' tokens into the cache; logits [V] of each row that completes its tokens."""
        counts = [r.count for r in rows]
        groups = [rows]
        if len(rows) * max(counts) > 2 * sum(counts) and 1 in counts:
            groups = [[r for r in rows if r.count == 1], [r for r in rows if r.count > 1]]
        out = []
        for group in groups:
            with torch.inference_mode():
                logits_BV = self._forward(group)
            for b, r in enumerate(group):
                if r.completes:
                    out.append((r, logits_BV[b]))
        return out

    def _forward(self, rows: Sequence[Scheduled]) -> torch.Tensor:
        """Plain loops, not comprehensions: this runs every decode step."""
        t, bs = max(r.count for r in rows), self.pool.block_size
        ids, positions, valid, slot_block, slot_offset, tables, last = [], [], [], [], [], [], []
        kv_len = 0
        for r in rows:
            request, blocks, n, pad = r.request, r.request.blocks, r.count, t - r.count
            tokens = (request.prompt_ids + request.out_ids)[r.start:r.start + n]
            ids.append(tokens + [0] * pad)
            pos = range(r.start, r.start + t)
            positions.append(pos)
            valid.append([True] * n + [False] * pad)
            slot_block.append([blocks[p // bs] for p in pos[:n]] + [SCRATCH] * pad)
            slot_offset.append([p % bs for p in pos[:n]] + list(range(pad)))
            tables.append(blocks)
            last.append(n - 1)
            kv_len = max(kv_len, r.start + n)
        width = -(-kv_len // bs)
        dev = self.device
        paged = (torch.tensor([x[:width] + [SCRATCH] * (width - len(x)) for x in tables], device=dev),
                 torch.tensor(slot_block, device=dev), torch.tensor(slot_offset, device=dev) % bs)
        batch = ForwardBatch.build(torch.tensor(positions, device=dev), valid_BT=torch.tensor(valid, device=dev),
                                   sliding_window=self.window, kv_len=kv_len, paged=paged)
        ids_BT = torch.tensor(ids, device=dev)
        self.on_pass(self._info(rows, ids_BT))
        logits_BV = self.model(ids_BT, batch, self.pool.cache, logits_at_B=torch.tensor(last, device=dev))
        for r in rows:
            r.request.num_computed = r.start + r.count
        self._last = (ids_BT, batch)
        return logits_BV

    def _info(self, rows: Sequence[Scheduled], ids_BT: torch.Tensor) -> PassInfo:
        phases: list[Phase] = []
        requests, starts, counts = [], [], []
        for r in rows:
            phases.append("decode" if r.count == 1 and r.request.decoding else "prefill")
            requests.append(r.request.request_id)
            starts.append(r.start)
            counts.append(r.count)
        fed_N = ids_BT.flatten() if len(rows) == 1 or min(counts) == ids_BT.shape[1] else ids_BT[
            torch.arange(ids_BT.shape[1]) < torch.tensor(counts)[:, None]]
        return PassInfo(next(self.passes), "prefill" if "prefill" in phases else "decode", tuple(requests),
                        tuple(starts), tuple(counts), tuple(phases), fed_N.cpu())

    def non_finite(self, decode_step: int | None) -> NumericalError:
        """Name where NaN or infinity first appeared in the last pass (re-run with the same positions)."""
        ids_BT, batch = self._last
        where = self.model.first_non_finite(ids_BT, batch, self.pool.cache)
        when = "in the prefill" if decode_step is None else f"at decode step {decode_step + 1}"
        return NumericalError(f"the model produced NaN or infinite logits {when}; they first appear in {where}. "
                              f"The checkpoint may hold NaN/inf weights, or the dtype overflows (try --dtype float32)")
