"""CUDA graphs of the one-request decode pass: the whole forward (every layer, the LM head) replayed as one launch.

A decode token of a MoE model is hundreds of small kernels; launched one by one from Python the GPU waits on the
host (`python -m benchmarks run decode_gpu` measures it). A graph
needs fixed shapes and no host reads, so:
- a replayed one-row decode pass reads its KV cache through a block table padded to a power-of-two width
  (`bucket`) under a mask of the positions written (models/attention.py `ForwardBatch.build(masked=True)`). Passes
  that run eagerly (`--no-cuda-graphs`, paged experts, a trace recorder) read their exact prefix instead (the
  padded pass would slow the eager step), so the two round
  differently (graphed runs are close to eager ones, not equal; paged runs equal the eager step bit for bit);
- one graph per width, captured into one shared memory pool (`DecodeGraphs.warm` captures, when the engine
  starts, every width of prefixes up to the cache, the model's context and WARM_POSITIONS, so no request below
  that pays a capture), inputs copied into its static buffers before each replay, its logits copied out after;
- only where nothing in the pass reads the device on the host: every expert resident, bf16 computed by
  `_grouped_mm` (its fp32 path reads the group offsets on the host) or int8 / int4 gathered on the device inside
  the graph (`ResidentExecutor.in_graph`: `indexed_rows`, not the eager `loop`, which reads the ids), the model's
  own router, no observer. Anything else runs eagerly. A capture that fails turns graphs off for the engine, with
  one warning.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from moepager.experts.executor import ExpertExecutor, ResidentExecutor
from moepager.models.attention import ForwardBatch
from moepager.models.layers import CausalLM
from moepager.runtime.kv_pool import SCRATCH, KVBlockPool

WARM_POSITIONS = 16384
"""`DecodeGraphs.warm` captures the widths of prefixes up to this many positions (the default KV cache's size)."""

Paged = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""A paged pass's (block table [1, W], slot block [1, 1], slot offset [1, 1]), as `ForwardBatch.build` takes them."""
Step = Callable[[], torch.Tensor]
Capture = Callable[[Step], Step]
"""Turns a step (a closure over static buffers) into its replay: a CUDA graph's, or on the CPU (tests) itself."""


def bucket(kv_len: int, block_size: int) -> int:
    """The block-table width of a one-row decode pass whose prefix is `kv_len` positions: the next power of two
    of the blocks it spans (2 or more), so a cache of W blocks needs log2(W) graphs."""
    need = max(2, -(-kv_len // block_size))
    return 1 << (need - 1).bit_length()


def graphable(model: CausalLM, experts: ExpertExecutor, device: torch.device) -> bool:
    """Whether this model's decode pass can be captured at all (the run-time conditions are `DecodeGraphs.usable`).
    Not with a sliding window: the runner reads such a model's exact window, unpadded (runner.py)."""
    return (device.type == "cuda" and not model.config.sliding_window and isinstance(experts, ResidentExecutor)
            and experts.graph_safe)


def cuda_capture(step: Step, pool: tuple[int, int] | None = None) -> Step:
    """`step` captured as a CUDA graph, after two warm-up runs on a side stream (as capture requires): the first
    may synchronize once to set a kernel up (`_grouped_mm`'s first call does, seen on an H200); the second must
    not, so a host read in every pass fails there, cleanly, rather than inside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a server's other threads may touch CUDA while the engine thread captures a wider table
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return out
    return replay


class _Graph:
    """One width's static inputs and the captured pass over them."""

    def __init__(self, model: CausalLM, cache: list[torch.Tensor], width: int, block_size: int, capture: Capture):
        dev = cache[0].device
        self.ids_BT = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.positions_BT = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.block_BT = torch.full((1, 1), SCRATCH, dtype=torch.long, device=dev)  # capture writes to scratch
        self.offset_BT = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.table_BW = torch.full((1, width), SCRATCH, dtype=torch.long, device=dev)
        self.last_B = torch.zeros(1, dtype=torch.long, device=dev)

        executors = {id(b.executor): b.executor for b in model.moe_blocks() if isinstance(b.executor, ResidentExecutor)}
        self.batch: ForwardBatch | None = None
        """The pass's batch over the static inputs, its mask computed inside the graph (the runner's `_last`)."""

        def step() -> torch.Tensor:
            batch = self.batch = ForwardBatch.build(self.positions_BT, kv_len=width * block_size, masked=True,
                                                    paged=(self.table_BW, self.block_BT, self.offset_BT))
            for executor in executors.values():  # layers that would read their ids on the host gather on the device
                executor.in_graph = True
            try:
                return model(self.ids_BT, batch, cache, logits_at_B=self.last_B)
            finally:
                for executor in executors.values():
                    executor.in_graph = False
        with torch.inference_mode():
            self.replay = capture(step)

    def run(self, ids_BT: torch.Tensor, positions_BT: torch.Tensor, paged: Paged) -> tuple[torch.Tensor, ForwardBatch]:
        """The pass's logits [1, V] (copied out: the next replay overwrites the static output) and its batch."""
        table_BW, block_BT, offset_BT = paged
        self.ids_BT.copy_(ids_BT)
        self.positions_BT.copy_(positions_BT)
        self.block_BT.copy_(block_BT)
        self.offset_BT.copy_(offset_BT)
        self.table_BW.copy_(table_BW)
        logits = self.replay().clone()
        assert self.batch is not None
        return logits, self.batch


class DecodeGraphs:
    """The engine's decode graphs, one per block-table width, captured lazily or all at once by `warm`; dropped
    when the KV cache is allocated again (the graphs hold its addresses)."""

    def __init__(self, model: CausalLM, pool: KVBlockPool, capture: Capture | None = None):
        self.model, self.pool = model, pool
        self._pool_handle = torch.cuda.graph_pool_handle() if capture is None else None
        self.capture: Capture = capture or (lambda step: cuda_capture(step, self._pool_handle))
        self.graphs: dict[int, _Graph] = {}
        self.allocation = -1
        self.enabled = True
        self.replays = 0
        """Decode passes replayed (tests and statistics)."""

    def usable(self) -> bool:
        """Graphs apply to this pass: none failed to capture, and the model routes with its own router and
        nothing observes it (a trace recorder, a prefetcher, a routing replay run eagerly: `traceable`)."""
        return self.enabled and self.model.traceable

    def run(self, ids_BT: torch.Tensor, positions_BT: torch.Tensor, paged: Paged
            ) -> tuple[torch.Tensor, ForwardBatch] | None:
        """The pass's logits [1, V] and batch, replayed from the graph of the block table's width (captured now if
        missing); None where the capture failed (the caller runs the pass eagerly, as it will from now on)."""
        graph = self._graph(paged[0].shape[1])
        if graph is None:
            return None
        self.replays += 1
        return graph.run(ids_BT, positions_BT, paged)

    def warm(self) -> None:
        """Capture every width a request can reach in the current cache and the model's context, up to
        WARM_POSITIONS (so none is captured mid-request below that; wider ones at their first use: capturing runs
        the pass, whose gathered prefix a huge cache would make large for nothing)."""
        positions = min(self.pool.capacity_tokens, self.model.config.max_position_embeddings, WARM_POSITIONS)
        width = bucket(positions, self.pool.block_size)
        w = 2
        while w <= width and self.usable():
            self._graph(w)
            w *= 2

    def _graph(self, width: int) -> _Graph | None:
        cache = self.pool.cache
        if self.pool.allocations != self.allocation:
            self.graphs.clear()
            self.allocation = self.pool.allocations
        graph = self.graphs.get(width)
        if graph is None and self.enabled:
            try:
                graph = self.graphs[width] = _Graph(self.model, cache, width, self.pool.block_size, self.capture)
            except RuntimeError as e:  # something in the pass reads the device on the host, or capture is refused
                self.enabled = False
                print(f"warning: CUDA graphs off for this engine (decode runs eagerly): capture failed: {e}",
                      file=sys.stderr)
                return None
        return graph
