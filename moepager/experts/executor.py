"""The expert executor seam: `run(layer, x_ND, route) -> out_ND`, one call per MoE layer.

Every executor computes a layer's routed experts from one arena (a `[rows, numel]` tensor whose rows are flat
expert buffers, experts/weights.py) and sums their outputs in one fixed order, so its output does not depend
on where the weights came from or when they arrived:
1. `sort_by_expert`: the N*K (token, k) pairs sorted by expert id (stable), the used experts and their token
   counts (the layer's one host sync: the expert ids must be known on the host to find their weights);
2. a kernel computes each used expert on its contiguous slice of sorted tokens (rows of the arena);
3. `combine`: outputs scaled by the routing weights, cast to x's dtype and `index_add_`-ed into zeros in
   sorted order, i.e. every token sums its experts in ascending id order: with the `loop` kernel the result is
   bit for bit that of experts/reference.py's reference `combine_experts` (tested).

Kernels (`--expert-kernel`; measured in benchmarks/README.md#expert_kernels and #cpu_kernels):
- `loop`: one pair of GEMMs per used expert on its slice; every kernel's reference order.
- `gather`: each (token, k) pair's expert weights copied out of the arena (`index_select`, gpt-fast's
  `w1[expert_indices]`) and one batched GEMM per projection.
- `grouped`: `torch._grouped_mm` over the arena viewed as `[rows, 2F, D]` with per-row token offsets: no gather and
  no Python loop over experts; the GPU path.
- `packed` (resident, CPU) and `fused` (moepager's CPU kernel, a `FusedKernel` from the composition root).
`auto`: `grouped` on CUDA; on the CPU the fused kernel where it applies (accel/cpu_kernels.py `fused_experts`), else
`loop` for one token and `grouped` for more.
A paged arena (the store's device slots and stream rows) computes what is resident at once, then the experts
still loading as they land, in one call per batch of those that have landed (`loop`: one by one), a prefill
computing while its loads run; each row's result does not depend on which call computed it.

Shape legend: N tokens, K top-k, M = N*K (token, k) pairs, D hidden, F expert FFN width, R arena rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from moepager.config import KERNELS, Kernel
from moepager.errors import ConfigError
from moepager.experts.onednn import packed_linear, packing_available, prepack, unavailable_reason
from moepager.experts.protocols import FusedKernel
from moepager.experts.quant import (
    dequantize_buffer_int4,
    int8_packed_mm,
    int8_packing_available,
    int8_prepack,
    sections,
)
from moepager.experts.reference import expert_forward
from moepager.experts.sorting import SortedTokens, sort_by_expert, sorted_on_device
from moepager.experts.weights import AnyExpertWeights, ExpertShape, expert_view
from moepager.store.store import ExpertStore
from moepager.store.tiers import Held
from moepager.types import RoutingDecision, long_tensor

Act = Callable[[torch.Tensor], torch.Tensor]


class ExpertExecutor(Protocol):
    compute_note: str
    """Which kernel computes when it is not torch's, and how when that is lossier than the experts' format ("" for
    torch's kernels at the format's own precision): a run reports it beside the format."""

    def run(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        """Sum over each token's K routed experts of weight * expert(token), for MoE layer `layer`."""
        ...


def group_ends(sorted_M: torch.Tensor, groups: int) -> torch.Tensor:
    """int32 [groups]: where each group's rows end in `sorted_M` (ascending group ids in 0..groups-1), i.e. the
    cumulative counts `_grouped_mm` takes as offsets. A binary search per group, not `cumsum(bincount)`: CUDA's
    bincount reads the ids' min and max on the host (two syncs per layer), searchsorted has a fixed output size."""
    return torch.searchsorted(sorted_M, torch.arange(groups, device=sorted_M.device, dtype=sorted_M.dtype),
                              right=True, out_int32=True)


BUCKET_BITS = 3
"""On the CPU a grouped call pads an expert's rows up to their count's top BUCKET_BITS significant bits (`bucketed`)."""
BUCKET_FROM = 1 << (BUCKET_BITS + 1)
"""Counts of rows below this stay as they are (each already one of few shapes)."""


def bucketed(counts: torch.Tensor) -> torch.Tensor:
    """Each count of rows (int64, >= 0) rounded up to a multiple of its top bit's 2**-BUCKET_BITS (counts below
    BUCKET_FROM kept): at most 1/2**BUCKET_BITS more rows, and 2**BUCKET_BITS sizes an octave. oneDNN builds a
    primitive per GEMM shape and keeps the last 1,024 it built; unpadded, the tokens an expert gets in a prompt are
    a new count each time, so every prompt added primitives to that cache (and built them) and the process's memory
    grew prompt after prompt (benchmarks/README.md#bigger_than_ram)."""
    top = torch.log2(counts.clamp(min=1).double()).floor().long()  # exact: counts are far below 2**52
    step = torch.where(counts < BUCKET_FROM, 1, 1 << (top - BUCKET_BITS).clamp(min=0))
    return (counts + step - 1) // step * step


class PaddedGroups(NamedTuple):
    """Rows of a grouped call padded to `bucketed` counts per group."""

    place_M: torch.Tensor
    """Where each row goes among the padded rows."""
    ends: torch.Tensor
    """int32 [groups]: where each padded group's rows end (`_grouped_mm`'s offsets)."""


def padded_groups(sorted_M: torch.Tensor, groups: int) -> PaddedGroups | None:
    """For `_grouped_mm` on the CPU: where each row of `sorted_M` (ascending group ids) goes once every group's rows
    are padded to `bucketed` counts with rows of zeros, and the padded groups' ends; None where no group pads (at
    once, without a tensor op, for a call of fewer than BUCKET_FROM rows: a batch of decodes)."""
    if len(sorted_M) < BUCKET_FROM:
        return None
    counts = torch.bincount(sorted_M, minlength=groups)
    padded = bucketed(counts)
    if torch.equal(padded, counts):
        return None
    ends, padded_ends = torch.cumsum(counts, 0), torch.cumsum(padded, 0)
    rank_M = torch.arange(len(sorted_M)) - (ends - counts)[sorted_M]
    return PaddedGroups((padded_ends - padded)[sorted_M] + rank_M, padded_ends.to(torch.int32))


def grouped_aligned(shape: ExpertShape) -> bool:
    """Whether `torch._grouped_mm` takes these experts on CUDA: every row stride a multiple of 16 bytes (a 1-wide
    expert, as `moepager calibrate` builds to time the overhead, is not: CUDA refuses it)."""
    size = shape.dtype.itemsize
    return shape.hidden * size % 16 == 0 and shape.intermediate * size % 16 == 0


def combine(x_ND: torch.Tensor, work: SortedTokens, y_MD: torch.Tensor) -> torch.Tensor:
    """Weighted outputs summed per token in sorted (ascending expert id) order. One token's K rows are summed by
    `sum(0)`, which equals `index_add_` into zeros bit for bit (both accumulate in fp32 row by row: tested
    against the reference) at a third of the cost."""
    y_MD = y_MD * work.w_M1
    if y_MD.dtype != x_ND.dtype:  # fp32 routing weights (Mixtral's)
        y_MD = y_MD.to(x_ND.dtype)
    if x_ND.shape[0] == 1:
        return y_MD.sum(0, keepdim=True)
    return torch.zeros_like(x_ND).index_add_(0, work.token_M, y_MD)


class ArenaKernels:
    """The three kernels over one arena; `views[row]` are the row's projection views."""

    def __init__(self, arena: torch.Tensor, shape: ExpertShape, kernel: Kernel = "auto", act: Act = F.silu,
                 fused: FusedKernel | None = None):
        if kernel not in KERNELS:
            raise ValueError(f"unknown expert kernel '{kernel}'; choose from {', '.join(KERNELS)}")
        if kernel == "packed":
            raise ConfigError("the 'packed' expert kernel computes resident experts only (it keeps no plain weights "
                              "to page); leave --expert-memory unset, or choose another --expert-kernel")
        if kernel == "fused" and fused is None:
            raise ConfigError("the 'fused' expert kernel was not built for these experts (accel/cpu_kernels.py)")
        if fused is not None and act is not F.silu:
            raise ConfigError("the fused expert kernel computes SwiGLU experts (SiLU) only")
        self.fused = fused
        """A layer's experts in one call on up to `fused.max_tokens` tokens (accel/cpu_kernels.py), or None."""
        if kernel == "fused":
            kernel = "auto"  # the kernels of calls past its max_tokens (none: it takes every size)
        if shape.quant is not None and kernel not in ("auto", "loop"):
            raise ConfigError(f"the '{kernel}' expert kernel computes float experts only; {shape.format_name} "
                              "experts run the 'loop' kernel (--expert-kernel auto or loop)")
        d, f = shape.hidden, shape.intermediate
        self.arena, self.shape, self.kernel, self.act = arena, shape, kernel, act
        self.quantized = shape.quant is not None
        self.resolved: Kernel = kernel if kernel != "auto" else "grouped" if arena.is_cuda and not self.quantized \
            and grouped_aligned(shape) else "loop"
        """The kernel of one-token calls (`auto` resolved by device; see `choose` for more tokens)."""
        self.batched: Kernel = "grouped" if kernel == "auto" and not arena.is_cuda and not self.quantized \
            and grouped_aligned(shape) else self.resolved
        """The kernel of calls on more tokens (see `choose`)."""
        self.views: list[AnyExpertWeights] = [expert_view(row, shape) for row in arena]
        self.scales_R2F: torch.Tensor | None = None
        """int8: each arena row's gate_up and down scales (None for float experts)."""
        self.int4_rows: tuple[torch.Tensor, ...] | None = None
        """int4 in the CPU kernel's layout: whole-arena views of the packed gate_up and down and their group scales."""
        self.int4_plain_rows: tuple[torch.Tensor, ...] | None = None
        """int4 as plain nibbles (CUDA, or the fused CPU kernel's "rows" layout): the same four whole-arena views."""
        if shape.quant is not None:  # whole-arena views of the quantized buffers' sections
            views = tuple(arena[:, s.offset: s.offset + s.nbytes].view(s.dtype).unflatten(1, s.shape)
                          for s in sections(d, f, shape.dtype, shape.quant)[0])
            if shape.quant.bits == 8:
                self.gate_up_R2FD, self.down_RDF, self.scales_R2F, self.scales_RD = views
            elif shape.quant.layout == "cpu":
                self.int4_rows = views
            else:
                self.int4_plain_rows = views
        if not self.quantized:
            self.gate_up_R2FD = arena[:, : 2 * f * d].view(-1, 2 * f, d)
            self.down_RDF = arena[:, 2 * f * d:].view(-1, d, f)
            self._transposed = [(w.gate_up_2FD.t(), w.down_DF.t()) for w in self.views]
            """Per row, the projections as `mm` takes them (F.linear's own transpose, done once)."""

    def fused_compute(self, fused: FusedKernel, work: SortedTokens, rows: Sequence[int], x_ND: torch.Tensor
                      ) -> torch.Tensor:
        """The layer's output with the fused kernel, every used expert at arena row rows[i] (all ready): its fp32
        weighted rows, then its per-token sum (the paged executor does the same in batches as experts land)."""
        y_MD = torch.empty(work.x_MD.shape, dtype=torch.float32)
        fused.rows(work, rows, range(len(rows)), y_MD, x_ND=x_ND, w_M=work.w_M1.reshape(-1).float(), arena=self.arena)
        return fused.combine(y_MD, work.token_M, x_ND.shape[0])

    def choose(self, tokens: int) -> Kernel:
        """The kernel for a call on `tokens` tokens: `auto` on the CPU (where the fused kernel does not apply) is
        `loop` for one token and `grouped` for more: a batch of decodes spreads over many experts with few tokens
        each, where one grouped call beats a GEMM pair per expert, and so does a prefill."""
        return self.batched if tokens > 1 else self.resolved

    def loop(self, work: SortedTokens, rows: Sequence[int], which: Sequence[int], out_MD: torch.Tensor,
             base: int = 0) -> None:
        """Experts `which` (indices into work.experts) computed one by one into their slices of out_MD, expert i
        from arena row base + rows[i] (the reference's `expert_forward`, written out: this is the hottest loop of
        a decode step)."""
        views, act, x_MD, starts = self.views, self.act, work.x_MD, work.starts
        if self.quantized:  # the formats' own kernels (experts/quant.py)
            for i in which:
                out_MD[starts[i]:starts[i + 1]] = expert_forward(x_MD[starts[i]:starts[i + 1]], views[base + rows[i]],
                                                                 act)
            return
        # F.linear's kernel (mm of the transposed weight) written out to save dispatches (slices, not chunk(), which
        # is a split of two narrows)
        f, transposed, one = self.shape.intermediate, self._transposed, work.x_1D
        for i in which:
            s, e = starts[i], starts[i + 1]
            gate_up_DF2, down_FD = transposed[base + rows[i]]
            gate_up_TF = torch.mm(x_MD[s:e] if one is None else one, gate_up_DF2)
            torch.mm(act(gate_up_TF[:, :f]) * gate_up_TF[:, f:], down_FD, out=out_MD[s:e])

    def _row_per_token(self, work: SortedTokens, rows: Sequence[int]) -> torch.Tensor:
        """The arena row of every sorted (token, k) pair."""
        per_row = [r for i, r in enumerate(rows) for _ in range(work.starts[i + 1] - work.starts[i])]
        return long_tensor(per_row, self.arena.device)  # on CUDA no sync (a paged layer's one is reading its ids)

    def gather(self, work: SortedTokens, rows: Sequence[int]) -> torch.Tensor:
        """Each (token, k) pair's expert weights indexed out of the arena, one batched GEMM per projection."""
        return self._gathered_swiglu(work.x_MD, self._row_per_token(work, rows))

    def _gathered_swiglu(self, x_MD: torch.Tensor, index_M: torch.Tensor) -> torch.Tensor:
        """Row i of x_MD through the expert of arena row index_M[i], whose weights are copied out (int8 ones
        converted to x's dtype as they are copied, which is exact, and scaled per output channel after each GEMM)."""
        if self.int4_rows is not None:
            return self._unrolled_int4_swiglu(x_MD, index_M)
        if self.int4_plain_rows is not None:  # the rows' nibbles copied out and dequantised at once
            q_gu, q_dn, s_gu, s_dn = self.int4_plain_rows
            layout = self.shape.quant.layout if self.shape.quant is not None else "plain"
            gate_up_M2FD, down_MDF = (dequantize_buffer_int4(q.index_select(0, index_M), s.index_select(0, index_M),
                                                             layout).to(x_MD.dtype)
                                      for q, s in ((q_gu, s_gu), (q_dn, s_dn)))
            h_M12F = torch.bmm(x_MD[:, None], gate_up_M2FD.transpose(1, 2))
            gate, up = h_M12F.chunk(2, dim=-1)
            return torch.bmm(self.act(gate) * up, down_MDF.transpose(1, 2))[:, 0]
        gate_up_M2FD = self.gate_up_R2FD.index_select(0, index_M)  # a row copy: advanced indexing is slower
        down_MDF = self.down_RDF.index_select(0, index_M)
        if self.scales_R2F is not None:
            gate_up_M2FD, down_MDF = gate_up_M2FD.to(x_MD.dtype), down_MDF.to(x_MD.dtype)
        h_M12F = torch.bmm(x_MD[:, None], gate_up_M2FD.transpose(1, 2))
        if self.scales_R2F is not None:
            h_M12F = h_M12F * self.scales_R2F.index_select(0, index_M)[:, None]
        gate, up = h_M12F.chunk(2, dim=-1)
        y_MD = torch.bmm(self.act(gate) * up, down_MDF.transpose(1, 2))[:, 0]
        return y_MD if self.scales_R2F is None else y_MD * self.scales_RD.index_select(0, index_M)

    def _unrolled_int4_swiglu(self, x_MD: torch.Tensor, index_M: torch.Tensor) -> torch.Tensor:
        """`_gathered_swiglu` for int4 experts in the CPU kernel's layout: row by row (unrolled when traced: a compiled
        step's M is its top-k), each row's packed weights and group scales copied out of the arena and computed
        by torch's int4 GEMV (`_weight_int4pack_mm_for_cpu`, what `loop` computes them with)."""
        assert self.int4_rows is not None and self.shape.quant is not None
        q_gu, q_dn, s_gu, s_dn = self.int4_rows
        f, group, int4_mm = self.shape.intermediate, self.shape.quant.group, torch.ops.aten._weight_int4pack_mm_for_cpu
        out = []
        for m in range(x_MD.shape[0]):
            row = index_M[m: m + 1]
            h_1F2 = int4_mm(x_MD[m: m + 1], q_gu.index_select(0, row)[0], group, s_gu.index_select(0, row)[0])
            out.append(int4_mm(self.act(h_1F2[:, :f]) * h_1F2[:, f:], q_dn.index_select(0, row)[0], group,
                               s_dn.index_select(0, row)[0]))
        return torch.cat(out)

    def indexed_rows(self, x_ND: torch.Tensor, route: RoutingDecision, base: int) -> torch.Tensor:
        """`gather` over one resident layer (expert e at arena row base + e) with the ids read on the device: no
        host sync and no Python per expert, so a compiled decode step traces it (accel/compiled.py). Each token
        sums its K experts in top-k order, not ascending id order: not bit-equal to `loop`."""
        ids_NK, weights_NK = route.ids_TK, route.weights_TK
        n, k = ids_NK.shape
        x_MD = x_ND[:, None].expand(n, k, x_ND.shape[1]).reshape(n * k, -1)
        y_MD = self._gathered_swiglu(x_MD, ids_NK.reshape(-1) + base) * weights_NK.reshape(-1, 1)
        return y_MD.to(x_ND.dtype).view(n, k, -1).sum(1)

    def _grouped_swiglu(self, x_MD: torch.Tensor, row_M: torch.Tensor, rows: slice) -> torch.Tensor:
        """Experts of arena rows `rows` on x_MD, whose row i is for arena row rows.start + row_M[i] (ascending). On the
        CPU each expert's rows are padded with zeros to a `bucketed` count, so a GEMM shape recurs (`padded_groups`):
        a row's result depends on its expert's count of rows, not on which other experts share the call (a paged
        layer's landed experts give the resident layer's bits)."""
        groups = len(self.arena[rows])
        padding = padded_groups(row_M, groups) if x_MD.device.type == "cpu" else None
        if padding is None:
            offs = group_ends(row_M, groups)
        else:
            offs = padding.ends
            x_MD = x_MD.new_zeros(int(offs[-1]), x_MD.shape[1]).index_copy_(0, padding.place_M, x_MD)
        h = torch._grouped_mm(x_MD, self.gate_up_R2FD[rows].transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y_MD = torch._grouped_mm(self.act(gate) * up, self.down_RDF[rows].transpose(1, 2), offs=offs)
        return y_MD if padding is None else y_MD.index_select(0, padding.place_M)

    def grouped(self, work: SortedTokens, rows: Sequence[int]) -> torch.Tensor:
        """`_grouped_mm` over the arena: rows sorted by arena row, an offset per arena row (empty groups skip)."""
        row_M = self._row_per_token(work, rows)
        by_row = torch.argsort(row_M, stable=True)
        out_MD = torch.empty_like(work.x_MD)
        out_MD[by_row] = self._grouped_swiglu(work.x_MD[by_row], row_M[by_row], slice(None))
        return out_MD

    def grouped_rows(self, x_ND: torch.Tensor, route: RoutingDecision, base: int, count: int) -> torch.Tensor:
        """`grouped` over arena rows base..base+count-1 (one resident layer, expert e at row base + e) without
        the host ever seeing the expert ids: no sync, nothing in Python per expert (the GPU path)."""
        work, sorted_M = sorted_on_device(x_ND, route)
        return combine(x_ND, work, self._grouped_swiglu(work.x_MD, sorted_M, slice(base, base + count)))

    def compute(self, work: SortedTokens, rows: Sequence[int], kernel: Kernel | None = None) -> torch.Tensor:
        """Every used expert at once (all of `rows` are ready)."""
        kernel = kernel or self.resolved
        if kernel == "gather":
            return self.gather(work, rows)
        if kernel == "grouped":
            return self.grouped(work, rows)
        out_MD = torch.empty_like(work.x_MD)
        self.loop(work, rows, range(len(rows)), out_MD)
        return out_MD


    def some(self, work: SortedTokens, rows: Sequence[int], which: Sequence[int], out_MD: torch.Tensor,
             kernel: Kernel) -> None:
        """Experts `which` (indices into work.experts, at arena rows rows[i]) computed in one call of `kernel` into
        their rows of out_MD (`loop`: one by one)."""
        if not which:
            return
        if kernel == "loop":
            self.loop(work, rows, which, out_MD)
            return
        pieces = [(work.starts[i], work.starts[i + 1]) for i in which]
        index_M = torch.cat([torch.arange(s, e, device=out_MD.device) for s, e in pieces])
        starts = [0]
        for s, e in pieces:
            starts.append(starts[-1] + e - s)
        part = SortedTokens(work.x_MD.index_select(0, index_M), work.w_M1.index_select(0, index_M),
                            work.token_M.index_select(0, index_M), [work.experts[i] for i in which], starts)
        out_MD[index_M] = self.compute(part, [rows[i] for i in which], kernel)

    def batch(self, work: SortedTokens, x_ND: torch.Tensor, y_MD: torch.Tensor | None = None) -> Batch:
        """How this layer call computes its experts a share at a time (as they land, or the share placed here): the
        fused kernel into fp32 weighted rows where it takes this many tokens, else `choose`'s kernel into rows in x's
        dtype; into `y_MD` when given (another arena's batch of the same format shares it)."""
        n, fused = x_ND.shape[0], self.fused
        if fused is not None and n <= fused.max_tokens:  # `fused_takes`, inline: per layer and token
            if y_MD is None:
                y_MD = torch.empty(work.x_MD.shape, dtype=torch.float32, device=x_ND.device)
            return Batch(y_MD, partial(fused.rows, x_ND=x_ND, w_M=work.w_M1.reshape(-1).float(), arena=self.arena),
                         "fused", fused)
        kernel = self.choose(n)
        return Batch(torch.empty_like(work.x_MD) if y_MD is None else y_MD, partial(self.some, kernel=kernel), kernel,
                     None)


def fused_takes(fused: FusedKernel | None, tokens: int) -> bool:
    """Whether the fused kernel computes a layer call on `tokens` tokens (into fp32 weighted rows), or the executor's
    own kernels do (into rows in x's dtype): every side that shares a layer's rows decides by this."""
    return fused is not None and tokens <= fused.max_tokens


@dataclass
class Batch:
    """A layer call's experts computed a share at a time into their rows of `y_MD` (`ArenaKernels.batch`)."""

    y_MD: torch.Tensor
    some: Callable[[SortedTokens, Sequence[int], Sequence[int], torch.Tensor], None]
    """`some(work, rows, which, y_MD)`: experts `which` (indices into work.experts) from arena rows rows[i]."""
    kernel: Kernel | Literal["fused"]
    fused: FusedKernel | None
    """The fused kernel when it computes (y_MD then holds fp32 rows already weighted), else None."""

    def combine(self, x_ND: torch.Tensor, work: SortedTokens) -> torch.Tensor:
        """Every token's sum of its rows in ascending expert order."""
        if self.fused is not None:
            return self.fused.combine(self.y_MD, work.token_M, x_ND.shape[0])
        return combine(x_ND, work, self.y_MD)


class ResidentExecutor:
    """Every routed expert in one arena on the device: row `base[layer] + expert`."""

    def __init__(self, arena: torch.Tensor, shape: ExpertShape, moe_layers: Sequence[int], num_experts: int,
                 kernel: Kernel = "auto", fused: FusedKernel | None = None):
        self.kernels = ArenaKernels(arena, shape, kernel, fused=fused)
        self.compute_note = fused.note if fused is not None else ""
        self.base = {layer: i * num_experts for i, layer in enumerate(moe_layers)}
        self.num_experts = num_experts
        self.in_graph = False
        """Set while a CUDA graph's pass runs (runtime/cuda_graphs.py): layers that would read their ids on the
        host compute on the device instead (`run_on_device`)."""

    @property
    def graph_safe(self) -> bool:
        """Whether a CUDA graph can capture these layers: bf16 rows under `_grouped_mm` (its fp32 path reads the
        group offsets on the host), or int8 / int4 rows gathered on the device (`indexed_rows`)."""
        kernels = self.kernels
        return kernels.resolved == "grouped" and kernels.arena.dtype == torch.bfloat16 or kernels.quantized

    def run(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        kernels, base = self.kernels, self.base[layer]
        fused = kernels.fused
        if fused is not None and x_ND.shape[0] <= fused.max_tokens:  # the whole layer in one call
            return fused.resident(x_ND, route.ids_TK, route.weights_TK, kernels.arena, base, self.num_experts)
        kernel = kernels.batched if x_ND.shape[0] > 1 else kernels.resolved  # `choose`, inlined: per layer and token
        if kernel == "grouped":  # the layer's own rows only: empty groups still cost
            return kernels.grouped_rows(x_ND, route, base, self.num_experts)
        if self.in_graph:
            return self.run_on_device(layer, x_ND, route)
        work = sort_by_expert(x_ND, route)
        if kernel == "loop":  # straight to the kernel, expert e at arena row base + e (a decode step's path)
            out_MD = torch.empty_like(work.x_MD)
            kernels.loop(work, work.experts, range(len(work.experts)), out_MD, base)
            return combine(x_ND, work, out_MD)
        return combine(x_ND, work, kernels.compute(work, [base + e for e in work.experts], kernel))

    def run_on_device(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        """`run` without a host sync, for a compiled decode step (`ArenaKernels.indexed_rows`; float, int8 or
        int4 experts)."""
        return self.kernels.indexed_rows(x_ND, route, self.base[layer])

    def weights(self, layer: int, expert: int) -> AnyExpertWeights:
        return self.kernels.views[self.base[layer] + expert]

    def stream(self, layer: int, experts: Sequence[int]):  # noqa: ANN201 - the reference's ExpertSource seam
        """Weights one by one (experts/reference.py's reference `combine_experts` reads them this way)."""
        for e in experts:
            yield self.weights(layer, e)


class PackedExecutor:
    """`--expert-kernel packed` (CPU, bf16 or int8, every expert resident; opt-in): each expert's two projections
    are prepacked at load, one MoE layer's arena at a time, each dropped once packed (so the memory is the same, the
    load's peak one layer's arena more); a layer's experts are computed one by one as `loop` computes them.
    - bf16: oneDNN's layout (experts/onednn.py): faster than torch's own GEMV on large matrices, slower on small
      ones, where a oneDNN call's fixed cost dominates (the built-in model's experts).
    - int8: FBGEMM's (`int8_prepack`), computed with the activations quantized to 8 bits per call
      (`int8_packed_mm`; lossier than weight-only int8, as llama.cpp's Q8_0 quantizes its activations), where
      `_weight_int8pack_mm` converts every weight to float.
    Not the default: it is not bit-equal to `loop` (another accumulation order; for int8, quantized
    activations), and a paged run, which computes with `loop`, must give the resident run's output."""

    def __init__(self, layer_arenas: Iterable[torch.Tensor], shape: ExpertShape, moe_layers: Sequence[int],
                 num_experts: int, device: torch.device):
        """`layer_arenas`: each MoE layer's experts in turn, as the rows of one arena (read lazily, so only one
        layer's arena need exist at a time)."""
        int8 = shape.quant is not None and shape.quant.bits == 8
        bf16 = shape.quant is None and shape.dtype == torch.bfloat16
        if device.type != "cpu" or not (bf16 or int8):
            raise ConfigError(f"the 'packed' expert kernel computes bf16 (oneDNN) or int8 (FBGEMM) experts on the "
                              f"CPU; these are {shape.format_name} on {device.type}")
        if bf16 and not packing_available() or int8 and not int8_packing_available():
            why = unavailable_reason() if bf16 else "this torch build has no FBGEMM engine"
            raise ConfigError(f"the 'packed' expert kernel cannot run here ({why}); choose another --expert-kernel")
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] = []
        for arena in layer_arenas:
            for w in (expert_view(row, shape) for row in arena):  # type: ignore[union-attr] - the views' format
                self.packed.append((int8_prepack(w.q_gate_up, w.s_gate_up), int8_prepack(w.q_down, w.s_down))
                                   if int8 else (prepack(w.gate_up_2FD), prepack(w.down_DF)))
        self.base = {layer: i * num_experts for i, layer in enumerate(moe_layers)}
        self.f, self.act = shape.intermediate, F.silu
        self.linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = int8_packed_mm if int8 else packed_linear
        self.compute_note = "packed kernel: activations quantized to 8 bits" if int8 else ""
        """What the kernel loses beyond the experts' format (a run reports it beside the format)."""

    def run(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        work, base, f = sort_by_expert(x_ND, route), self.base[layer], self.f
        out_MD = torch.empty_like(work.x_MD)
        for i, e in enumerate(work.experts):
            s, end = work.starts[i], work.starts[i + 1]
            gate_up, down = self.packed[base + e]
            h_TF = self.linear(work.x_MD[s:end] if work.x_1D is None else work.x_1D, gate_up)
            out_MD[s:end] = self.linear(self.act(h_TF[:, :f]) * h_TF[:, f:], down)
        return combine(x_ND, work, out_MD)

    def stream(self, layer: int, experts: Sequence[int]):  # noqa: ANN201 - the reference's ExpertSource seam
        raise ConfigError("the 'packed' expert kernel keeps no plain expert weights to stream")


class PagedExecutor:
    """Experts paged through the expert store: the layer's experts are acquired at once (hits pinned, misses
    loading, those beyond the layer's cache queued for the store's stream rows), the resident ones computed,
    then each batch of loads that has landed (`loop`: expert by expert), each stream row handed back to the
    store as soon as its expert is computed, until none is left; then released."""

    def __init__(self, store: ExpertStore, shape: ExpertShape, kernel: Kernel = "auto",
                 fused: FusedKernel | None = None):
        self.store = store
        self.kernels = ArenaKernels(store.device.buffers, shape, kernel, fused=fused)
        self.compute_note = fused.note if fused is not None else ""

    def run(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision, work: SortedTokens | None = None
            ) -> torch.Tensor:
        """`work`: the tokens already sorted by expert (else sorted here)."""
        if work is None:
            work = sort_by_expert(x_ND, route)
        batch = self.kernels.batch(work, x_ND)
        held = self.store.acquire(layer, work.experts)  # its ready experts need no wait
        try:
            if batch.fused is None and batch.kernel != "loop" and not held.pending and not held.queued:
                return combine(x_ND, work, self.kernels.compute(work, held.slots, batch.kernel))  # one call, no copy
            self._as_they_land(held, work, None, batch)
        finally:
            self.store.release(held)
        fused = batch.fused  # `Batch.combine`, inline (a call less per layer and token)
        return fused.combine(batch.y_MD, work.token_M, x_ND.shape[0]) if fused is not None else \
            combine(x_ND, work, batch.y_MD)

    def through_store(self, layer: int, work: SortedTokens, which: Sequence[int], batch: Batch,
                      cache: bool = True) -> None:
        """Experts `which` (indices into work.experts) acquired from the store and computed into their rows of
        `batch.y_MD` as they land, then released; not `cache`: the misses pass through the stream rows only
        (`ExpertStore.acquire`)."""
        held = self.store.acquire(layer, [work.experts[i] for i in which], cache)
        try:
            self._as_they_land(held, work, which, batch)
        finally:
            self.store.release(held)

    def _as_they_land(self, held: Held, work: SortedTokens, which: Sequence[int] | None, batch: Batch) -> None:
        """The ready experts of `held`, then each batch of its loads as it lands (stream rows recycled). `which`:
        the index into work.experts of each held expert (None: the same index)."""
        rows = held.slots if which is None else [-1] * len(work.experts)
        some, y_MD, store = batch.some, batch.y_MD, self.store
        landed, pending = held.ready, list(held.pending)
        while True:
            if landed and which is None:
                some(work, rows, landed, y_MD)
            elif landed:  # held expert j is work.experts[which[j]]; its slot may be a recycled stream row
                for j in landed:
                    rows[which[j]] = held.slots[j]
                some(work, rows, [which[j] for j in landed], y_MD)
            if held.streaming:  # computed: their stream rows take the next queued misses
                pending += store.recycle(held, landed)
            if not pending:
                return
            landed = store.wait_landed(held, pending)
            done = set(landed)
            pending = [i for i in pending if i not in done]

    def stream(self, layer: int, experts: Sequence[int]):  # noqa: ANN201 - the reference's ExpertSource seam
        for slot in self.store.stream(layer, experts):
            yield self.kernels.views[slot]
