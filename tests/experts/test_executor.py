"""The expert executor: every kernel against the slow reference, and paged against resident bit for bit."""

from __future__ import annotations

import pytest
import torch

from moepager.config import StoreConfig
from moepager.experts.executor import (
    BUCKET_BITS,
    BUCKET_FROM,
    ArenaKernels,
    ResidentExecutor,
    bucketed,
    group_ends,
    grouped_aligned,
    padded_groups,
)
from moepager.experts.quant import QuantFormat, quantize_expert
from moepager.experts.reference import combine_experts
from moepager.experts.sorting import sort_by_expert
from moepager.experts.weights import ExpertShape, expert_view
from moepager.loading.build import resident_executor
from moepager.placements.paged import paged_executor
from moepager.runtime.builder import load_model
from moepager.types import RoutingDecision
from tests.conftest import expert_budget
from tests.runtime.test_offload import logits_run

CPU = torch.device("cpu")


def routed(tokens: int, experts: int = 6, k: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    return RoutingDecision(ids, torch.rand(tokens, k, generator=gen), torch.zeros(tokens, experts))


@pytest.mark.parametrize("tokens", [1, 2, 9])
@pytest.mark.parametrize("kernel", ["loop", "gather", "grouped"])
def test_every_kernel_computes_the_reference_sum(kernel, tokens):
    gen = torch.Generator().manual_seed(1)
    shape = ExpertShape(16, 8, torch.float32)
    arena = torch.randn(2 * 6, shape.numel, generator=gen)
    executor = ResidentExecutor(arena, shape, moe_layers=[3, 5], num_experts=6, kernel=kernel)
    x = torch.randn(tokens, 16, generator=gen)
    route = routed(tokens)
    ref = combine_experts(x, route, executor, layer=5, num_experts=6)
    got = executor.run(5, x, route)
    if kernel == "loop":
        assert torch.equal(got, ref)  # the same per-expert calls, the same summation order
    else:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def random_arena(rows: int, shape: ExpertShape, gen: torch.Generator) -> torch.Tensor:
    """`rows` random experts in `shape`'s format (quantized ones quantized from random float weights)."""
    if shape.quant is None:
        return torch.randn(rows, shape.numel, generator=gen, dtype=shape.dtype)
    arena = torch.empty(rows, shape.numel, dtype=torch.uint8)
    d, f = shape.hidden, shape.intermediate
    for row in arena:
        quantize_expert(torch.randn(2 * f, d, generator=gen), torch.randn(d, f, generator=gen),
                        expert_view(row, shape), shape.dtype)  # type: ignore[arg-type]
    return arena


@pytest.mark.parametrize("quant, hidden", [(None, 16), (QuantFormat(8), 16), (QuantFormat(4, 32), 64),
                                           (QuantFormat(4, 32, False, "plain"), 64),
                                           (QuantFormat(4, 32, True, "plain"), 64)],
                         ids=["float", "int8", "int4", "int4-plain", "int4-plain-zero-points"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_the_on_device_path_computes_the_reference_sum_without_reading_ids_on_the_host(tokens, quant, hidden):
    """What a compiled decode step traces (accel/compiled.py): ids whose host copy raises are never read there.
    int8 experts are converted as they are copied out and scaled after each GEMM; the reference runs torch's int8
    GEMV kernel. int4 experts are copied packed into the same int4 kernel the reference runs, row by row; plain
    int4 (CUDA's layout) is copied out and dequantised for all rows at once."""
    gen = torch.Generator().manual_seed(5)
    shape = ExpertShape(hidden, hidden // 2, torch.float32, quant)
    executor = ResidentExecutor(random_arena(2 * 6, shape, gen), shape, moe_layers=[3, 5], num_experts=6,
                                kernel="loop")
    x, route = torch.randn(tokens, hidden, generator=gen), routed(tokens, seed=tokens)

    class NoHost(torch.Tensor):
        def tolist(self):
            raise AssertionError("the ids were read on the host")

    on_device = RoutingDecision(route.ids_TK.as_subclass(NoHost), route.weights_TK, route.scores_TE)
    got = executor.run_on_device(5, x, on_device)
    tol = 1e-4 if quant is not None and quant.layout == "plain" else 1e-5  # plain int4: bmm here, F.linear there
    torch.testing.assert_close(got, combine_experts(x, route, executor, layer=5, num_experts=6), rtol=tol, atol=tol)
    assert got.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 3])
def test_the_loop_kernel_equals_the_reference_bit_for_bit_in_every_dtype(dtype, tokens):
    """One token sums its K rows with `sum(0)`, more with `index_add_`; the reference always uses index_add_."""
    gen = torch.Generator().manual_seed(2)
    shape = ExpertShape(64, 32, dtype)
    executor = ResidentExecutor((torch.randn(2 * 8, shape.numel, generator=gen) / 8).to(dtype), shape,
                                moe_layers=[0, 1], num_experts=8, kernel="loop")
    for seed in range(20):
        x = torch.randn(tokens, 64, generator=gen).to(dtype)
        route = routed(tokens, experts=8, k=4, seed=seed)
        route = RoutingDecision(route.ids_TK, route.weights_TK.to(dtype) if seed % 2 else route.weights_TK, None)
        assert torch.equal(executor.run(1, x, route), combine_experts(x, route, executor, layer=1, num_experts=8))


def test_sorting_finds_each_used_expert_and_its_tokens():
    route = RoutingDecision(torch.tensor([[4, 0], [1, 4], [4, 1]]), torch.ones(3, 2), torch.zeros(3, 5))
    work = sort_by_expert(torch.arange(3.0)[:, None], route)
    assert work.experts == [0, 1, 4] and work.starts == [0, 1, 3, 6]
    assert work.token_M.tolist() == [0, 1, 2, 0, 1, 2]  # stable: tokens in order within an expert
    one = sort_by_expert(torch.ones(1, 1), RoutingDecision(torch.tensor([[3, 1, 2]]), torch.ones(1, 3), None))
    assert one.experts == [1, 2, 3] and one.starts == [0, 1, 2, 3]


@pytest.mark.parametrize("seed", range(20))
def test_group_ends_are_the_cumulative_counts_empty_groups_included(seed):
    g = torch.Generator().manual_seed(seed)
    groups = int(torch.randint(1, 12, (1,), generator=g))
    sorted_M = torch.sort(torch.randint(0, groups, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g))[0]
    expected = torch.cumsum(torch.bincount(sorted_M, minlength=groups), 0).to(torch.int32)
    ends = group_ends(sorted_M, groups)
    assert ends.dtype == torch.int32 and torch.equal(ends, expected)


def test_grouped_gemm_is_chosen_only_for_experts_whose_rows_cuda_takes():
    """CUDA's `_grouped_mm` refuses strides that are not multiples of 16 bytes (seen on an H200 when `calibrate`
    timed 1-wide experts): `auto` loops over those instead."""
    assert grouped_aligned(ExpertShape(2048, 768, torch.bfloat16))
    assert grouped_aligned(ExpertShape(64, 4, torch.float32))
    assert not grouped_aligned(ExpertShape(2048, 1, torch.bfloat16))
    assert not grouped_aligned(ExpertShape(2048, 4, torch.bfloat16))
    assert not grouped_aligned(ExpertShape(12, 8, torch.bfloat16))


def test_auto_loops_one_token_and_groups_more_on_the_cpu():
    shape = ExpertShape(16, 8, torch.bfloat16)
    kernels = ArenaKernels(torch.zeros(6, shape.numel, dtype=torch.bfloat16), shape)
    assert (kernels.choose(1), kernels.choose(4)) == ("loop", "grouped")
    pinned = ArenaKernels(torch.zeros(6, shape.numel, dtype=torch.bfloat16), shape, "loop")
    assert (pinned.choose(1), pinned.choose(4)) == ("loop", "loop")


@pytest.mark.parametrize("kernel", ["loop", "gather", "grouped"])
def test_paged_execution_equals_resident_bit_for_bit_with_each_kernel(hf_checkpoint, kernel):
    """Both executors share the kernels and the summation order: at the minimum budget (prefill streams
    experts one at a time), a middle one and all experts, with experts from disk and from a host tier."""
    _, path = hf_checkpoint("qwen3_moe")
    resident = load_model(path, executor_factory=resident_executor(CPU, kernel), show_progress=False)
    ref = logits_run(resident, rows=1) + logits_run(resident)
    nbytes, cfg = resident.expert_shape.nbytes, resident.config
    total = cfg.num_moe_layers * cfg.num_experts
    for slots in (cfg.top_k, total // 2, total):
        for host_tier in (False, True):
            budget = str(slots * nbytes) if host_tier else expert_budget(nbytes, slots)
            paged = load_model(path, executor_factory=paged_executor(StoreConfig(expert_memory=budget), CPU, kernel,
                                                                     host_tier=host_tier), show_progress=False)
            got = logits_run(paged, rows=1) + logits_run(paged)
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), (slots, host_tier)
            paged.experts.store.close()


def test_a_paged_prefill_computes_landed_experts_while_others_still_load():
    """`grouped` over several tokens: experts that landed are computed while a slow read is still running
    (the slow one is computed when it lands), and the result is the resident executor's, bit for bit."""
    import threading

    from moepager.experts.executor import PagedExecutor
    from moepager.policies.lru import LRU
    from moepager.policies.prefetch import PrefetchAware
    from moepager.store.slots import SlotTable
    from moepager.store.store import ExpertStore
    from moepager.store.tiers import Tier
    from moepager.store.transfer import Transfers
    from moepager.types import ExpertKey

    gen = torch.Generator().manual_seed(3)
    shape = ExpertShape(16, 8, torch.float32)
    arena = torch.randn(6, shape.numel, generator=gen)
    x, route = torch.randn(9, 16, generator=gen), routed(9, experts=6, k=3, seed=4)
    slow, gate = 0, threading.Event()

    def read(key: ExpertKey, out: torch.Tensor, between=None) -> int:
        if key.expert == slow:
            gate.wait(timeout=10)
        out.copy_(arena[key.expert])
        return out.numel() * out.element_size()

    table = SlotTable(6, [0], PrefetchAware(LRU()), "layer")
    store = ExpertStore(Tier(table, torch.zeros(6, shape.numel)), None, read,
                        Transfers(CPU, io_threads=2))
    executor = PagedExecutor(store, shape, "grouped")
    calls: list[list[int]] = []
    compute = executor.kernels.compute
    others = set(route.ids_TK.flatten().tolist()) - {slow}

    def recording(work, rows, kernel=None):
        calls.append(list(work.experts))
        if {e for c in calls for e in c} >= others:
            gate.set()  # the slow read finishes only after every other expert was computed: it is the last call
        return compute(work, rows, kernel)

    executor.kernels.compute = recording
    try:
        got = executor.run(0, x, route)
    finally:
        gate.set()
        store.close()
    ref = ResidentExecutor(arena, shape, moe_layers=[0], num_experts=6, kernel="grouped").run(0, x, route)
    assert torch.equal(got, ref)
    assert len(calls) >= 2 and slow not in calls[0] and slow in calls[-1], calls
    assert sorted(e for c in calls for e in c) == sorted(set(route.ids_TK.flatten().tolist()))


class _DeviceIds(torch.Tensor):
    """Ids that refuse to be read on the host: what a CUDA tensor's `tolist` would cost, a sync, made loud."""

    def tolist(self):  # noqa: ANN201 - torch.Tensor's own signature
        raise AssertionError("device ids read on the host")


@pytest.mark.parametrize("tokens", [1, 3])
def test_sorting_reads_the_host_copy_of_the_ids_when_the_route_has_one(tokens):
    ids = torch.tensor([[4, 0], [1, 4], [4, 1]])[:tokens]
    x = torch.arange(float(tokens))[:, None]
    route = RoutingDecision(ids.as_subclass(_DeviceIds), torch.ones(tokens, 2), torch.zeros(tokens, 5))
    with pytest.raises(AssertionError, match="device ids read on the host"):
        sort_by_expert(x, route)
    work = sort_by_expert(x, route._replace(ids_host_TK=ids))
    plain = sort_by_expert(x, RoutingDecision(ids, torch.ones(tokens, 2), torch.zeros(tokens, 5)))
    assert (work.experts, work.starts) == (plain.experts, plain.starts)
    assert torch.equal(work.x_MD, plain.x_MD) and torch.equal(work.token_M.as_subclass(torch.Tensor), plain.token_M)


def test_an_observed_block_hands_its_observers_and_executor_one_host_copy_of_the_ids():
    from moepager.models.moe import MoEBlock, SoftmaxTopKRouter

    seen = []

    class Observer:
        def stage(self, layer, x_ND, route):  # noqa: ANN001, ANN201
            return ()

        def routed(self, layer, x_ND, route, staged):  # noqa: ANN001, ANN201
            seen.append(route.ids_host_TK)

    class Executor:
        def run(self, layer, x_ND, route):  # noqa: ANN001, ANN201
            seen.append(route.ids_host_TK)
            return torch.zeros_like(x_ND)

    gate = SoftmaxTopKRouter(8, 4, 2, normalize=True, fp32_weights=False)
    torch.nn.init.normal_(gate.weight)
    block = MoEBlock(gate, Executor(), layer=0, num_experts=4)
    block.observer = Observer()
    block(torch.randn(3, 8))
    assert seen[0] is not None and seen[0] is seen[1] and seen[0].shape == (3, 2)


def test_bucketed_counts_waste_at_most_an_eighth_and_recur():
    """A CPU grouped call pads each expert's rows to a bucketed count: never fewer, at most 1/8 more, small counts
    kept, and few sizes in all (oneDNN keeps a primitive per GEMM shape it builds)."""
    counts = torch.arange(0, 8193)
    padded = bucketed(counts)
    assert (padded >= counts).all() and ((padded - counts) * 8 <= counts).all()
    assert torch.equal(padded[:BUCKET_FROM], counts[:BUCKET_FROM])
    assert len(set(padded.tolist())) <= BUCKET_FROM + 2**BUCKET_BITS * 10  # per octave up to 2**13
    assert padded_groups(torch.tensor([0] * 20 + [2] * 3), 3) is None  # 20 and 3 are already sizes: nothing pads
    place, ends = padded_groups(torch.tensor([0] * 21 + [2] * 3 + [3] * 41), 5)
    assert ends.tolist() == [22, 22, 25, 69, 69] and place.tolist() == [*range(21), 22, 23, 24, *range(25, 66)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_rows_padded_to_buckets_give_each_expert_s_bits_whatever_shares_the_call(dtype):
    """Padding with zero rows changes no row beyond rounding, and a row's bits depend on its expert's count alone:
    a subset of the experts (a paged layer's landed ones) computes them as the whole call does."""
    gen = torch.Generator().manual_seed(3)
    shape = ExpertShape(64, 48, dtype)
    kernels = ArenaKernels(torch.randn(6, shape.numel, generator=gen).to(dtype) / 8, shape, "grouped")
    counts = torch.tensor([17, 0, 33, 100, 5, 250])
    row_M = torch.repeat_interleave(torch.arange(6), counts)
    x_MD = torch.randn(len(row_M), 64, generator=gen).to(dtype)
    assert padded_groups(row_M, 6) is not None
    every = kernels._grouped_swiglu(x_MD, row_M, slice(None))
    reference = torch.cat([expert_forward_rows(kernels, x_MD[row_M == e], e) for e in range(6)])
    torch.testing.assert_close(every.float(), reference.float(), rtol=2e-2, atol=2e-2)
    some = row_M >= 3  # experts 3, 4 and 5 alone, renumbered
    alone = kernels._grouped_swiglu(x_MD[some], row_M[some] - 3, slice(3, 6))
    assert torch.equal(alone, every[some])


def expert_forward_rows(kernels: ArenaKernels, x_TD: torch.Tensor, row: int) -> torch.Tensor:
    """Expert `row`'s SwiGLU on x_TD, in fp32 from its weights."""
    gate_up, down = kernels.gate_up_R2FD[row].float(), kernels.down_RDF[row].float()
    h = x_TD.float() @ gate_up.T
    gate, up = h.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ down.T
