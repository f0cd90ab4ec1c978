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
from moepager.models.attention import ForwardBatch
from moepager.models.layers import CausalLM
from moepager.runtime.cuda_graphs import DecodeGraphs, bucket
from moepager.runtime.kv_pool import SCRATCH, KVBlockPool
from moepager.runtime.scheduler import Scheduled
from moepager.types import PassInfo, Phase, long_tensor

OnPass = Callable[[PassInfo], None]
"""Called before each forward pass (store, prefetcher, recorder, replayer)."""


def ignore_pass(info: PassInfo) -> None:
    """The `on_pass` of runs that neither page experts, record a trace nor prefetch."""


def pass_groups(rows: Sequence[Scheduled], batch_invariant: bool) -> list[Sequence[Scheduled]]:
    """The forward passes a step's rows run as: one, or (batch-invariant) one per row, or the decodes then the prompt
    chunks when their lengths differ so much that padding would more than double the tokens computed."""
    if batch_invariant:
        return [[r] for r in rows]
    counts = [r.count for r in rows]
    if len(rows) * max(counts) > 2 * sum(counts) and 1 in counts:
        return [[r for r in rows if r.count == 1], [r for r in rows if r.count > 1]]
    return [rows]


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVBlockPool, device: torch.device, on_pass: OnPass = ignore_pass,
                 graphs: DecodeGraphs | None = None, batch_invariant: bool = False):
        self.model, self.pool, self.device = model, pool, device
        self.batch_invariant = batch_invariant
        """Every row a pass of its own (SchedulerConfig.batch_invariant)."""
        self.on_pass = on_pass
        self.window = model.config.sliding_window
        self.passes = itertools.count()
        self.graphs = graphs
        """CUDA graphs of one-row decode passes (runtime/cuda_graphs.py), where the model's pass can be captured."""

    def run(self, rows: Sequence[Scheduled]) -> list[tuple[Scheduled, torch.Tensor]]:
        """Compute the rows' tokens into the cache; logits [V] of each row that completes its tokens."""
        out = []
        for group in pass_groups(rows, self.batch_invariant):
            with torch.inference_mode():
                logits_BV = self._forward(group)
            for b, r in enumerate(group):
                if r.completes:
                    out.append((r, logits_BV[b]))
        return out

    def _forward(self, rows: Sequence[Scheduled]) -> torch.Tensor:
        """Plain loops, not comprehensions: this runs every decode step. The batch's metadata is built on the
        host and reaches the device in one copy (on CUDA from pinned memory, asynchronously: no host sync)."""
        b, t, bs = len(rows), max([r.count for r in rows]), self.pool.block_size
        ids, positions, slot_block, slot_offset, tables, last, valid, fed = [], [], [], [], [], [], [], []
        kv_len = 0
        for i, r in enumerate(rows):
            request, blocks, n, pad = r.request, r.request.blocks, r.count, t - r.count
            tokens = request.tokens(r.start, n)
            ids += tokens + [0] * pad
            fed += tokens
            pos = range(r.start, r.start + t)
            positions += pos
            slot_block += [blocks[p // bs] for p in pos[:n]] + [SCRATCH] * pad
            slot_offset += [p % bs for p in pos[:n]] + [p % bs for p in range(pad)]
            tables.append(blocks)
            last.append(n - 1)
            valid += range(i * t, i * t + n)
            kv_len = max(kv_len, r.start + n)
        # Blocks past kv_len, 2 or more: a compiled step's graph would specialise a width of 1, and a prefix that
        # fills its blocks exactly (compile again; accel/compiled.py). One row's one token replayed from a CUDA
        # graph: a power of two under a mask, the graph's shapes (runtime/cuda_graphs.py)
        graphs = self.graphs if b * t == 1 and self.graphs is not None and self.graphs.usable() else None
        width = bucket(kv_len, bs) if graphs is not None else max(2, kv_len // bs + 1)
        table = [block for x in tables for block in x[:width] + [SCRATCH] * (width - len(x))]
        padded = len(valid) < b * t
        parts = [ids, positions, slot_block, slot_offset, table, last] + ([valid] if padded else [])
        ids_BT, positions_BT, block_BT, offset_BT, table_BW, last_B, *valid_N = self._to_device(parts)
        shape = (b, t)
        self.on_pass(self._info(rows, torch.tensor(fed)))
        ids_BT, positions_BT = ids_BT.view(shape), positions_BT.view(shape)
        paged = (table_BW.view(b, width), block_BT.view(shape), offset_BT.view(shape))
        replayed = graphs.run(ids_BT, positions_BT, paged) if graphs is not None else None
        if replayed is not None:  # the graph's own batch: its mask is computed inside the graph
            logits_BV, batch = replayed
        else:
            batch = ForwardBatch.build(positions_BT, valid_N=valid_N[0] if padded else None, sliding_window=self.window,
                                       kv_len=width * bs if graphs is not None else kv_len, masked=graphs is not None,
                                       paged=paged)
            logits_BV = self.model(ids_BT, batch, self.pool.cache, logits_at_B=last_B)
        for r in rows:
            r.request.num_computed = r.start + r.count
        self._last = (ids_BT, batch)
        return logits_BV

    def _to_device(self, parts: list[list[int]]) -> list[torch.Tensor]:
        """Integer lists as device tensors, through one host tensor and one copy."""
        flat = long_tensor(list(itertools.chain.from_iterable(parts)), self.device)
        return list(flat.split([len(part) for part in parts]))

    def _info(self, rows: Sequence[Scheduled], fed_N: torch.Tensor) -> PassInfo:
        """The pass as observers see it; its tokens come from the host lists (on CUDA: no copy back, no sync)."""
        phases: list[Phase] = []
        requests, starts, counts, blocks = [], [], [], []
        for r in rows:
            phases.append("decode" if r.decoding else "prefill")
            requests.append(r.request.request_id)
            starts.append(r.start)
            counts.append(r.count)
            blocks.append(r.request.blocks)
        return PassInfo(next(self.passes), "prefill" if "prefill" in phases else "decode", tuple(requests),
                        tuple(starts), tuple(counts), tuple(phases), fed_N, tuple(blocks))

    def non_finite(self, decode_step: int | None) -> NumericalError:
        """Name where NaN or infinity first appeared in the last pass (re-run with the same positions)."""
        ids_BT, batch = self._last
        where = self.model.first_non_finite(ids_BT, batch, self.pool.cache)
        when = "in the prefill" if decode_step is None else f"at decode step {decode_step + 1}"
        return NumericalError(f"the model produced NaN or infinite logits {when}; they first appear in {where}. "
                              f"The checkpoint may hold NaN/inf weights, or the dtype overflows (try --dtype float32)")
