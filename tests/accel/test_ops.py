"""The kernels as torch.library operators (accel/ops.py): each tier in a namespace of its own, schemas that name every
argument, fake kernels a compiled graph can trace, and the GIL released while one computes."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from moepager.accel import cpu_kernels, cpu_tiers

BF16 = torch.bfloat16


def tensor_calls(k) -> dict[str, tuple]:  # noqa: ANN001 - a tier's Kernels
    """Each operator on tensors alone with small valid arguments."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g).to(BF16)
    w = torch.randn(48, 64, generator=g).to(BF16)
    q = torch.randint(-127, 128, (48, 64), dtype=torch.int8, generator=g)
    y, token = torch.randn(6, 64, generator=g), torch.tensor([0, 0, 1, 1, 2, 2])
    heads, kv, dh, block = 2, 1, 16, 8
    qkv = torch.randn(2, (heads + 2 * kv) * dh, generator=g).to(BF16)
    cache = torch.zeros(4, block, 2 * kv, dh, dtype=BF16)
    return {
        "rms_norm": (x, torch.ones(64, dtype=BF16), 1e-6),
        "router_topk": (x, w[:8], 2, True),
        "linear_bf16": (x, w),
        "linear_int8": (x, q, torch.full((48,), 0.01).to(BF16)),
        "moe_combine": (y, token, 3),
        "greedy_rows": (torch.randn(2, 50, generator=g).to(BF16),),
        "decode_attention": (qkv, torch.empty(0, dtype=BF16), 1e-6, torch.ones(2, dh, dtype=BF16),
                             torch.zeros(2, dh, dtype=BF16), cache, torch.tensor([[0, 1], [2, 3]]),
                             torch.tensor([3, 9]), heads, 0, 0.25),
    }


def test_each_tier_registers_its_operators_in_a_namespace_of_its_own(tier):
    k = cpu_kernels.extension()
    assert k.namespace == cpu_tiers.BY_NAME[tier].module_name and k.tier == tier
    ops = getattr(torch.ops, k.namespace)
    for name in ("moe_partial", "moe_resident", "moe_combine", "linear_bf16", "rms_norm", "decode_attention"):
        schema = getattr(ops, name).default._schema
        assert all(a.name and not a.name.startswith("_") for a in schema.arguments), schema
    attention = ops.decode_attention.default._schema
    assert [a.name for a in attention.arguments if a.alias_info and a.alias_info.is_write] == ["cache"]


@pytest.mark.parametrize("name", ["rms_norm", "router_topk", "linear_bf16", "linear_int8", "moe_combine",
                                  "greedy_rows", "decode_attention"])
def test_the_operators_on_tensors_pass_torchs_checks_of_schema_and_fake_kernel(name, tier):
    """torch.library.opcheck: the schema matches what the kernel does (mutation, aliasing), and the fake kernel
    gives the real outputs' shapes, dtypes and strides."""
    k = cpu_kernels.extension()
    op = getattr(torch.ops, k.namespace).__getattr__(name).default
    torch.library.opcheck(op, tensor_calls(k)[name], test_utils=("test_schema", "test_faketensor"))


def test_a_compiled_graph_holds_the_operators_whole(tier):
    """Norm, router and GEMV in one function compile with no graph break (fullgraph) and compute the eager bits."""
    k = cpu_kernels.extension()
    calls = tensor_calls(k)
    x, norm_w = calls["rms_norm"][0], calls["rms_norm"][1]
    w = calls["linear_bf16"][1]

    def step(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = k.rms_norm(x, norm_w, 1e-6)
        ids, weights, _ = k.router_topk(h, w[:8], 2, True)
        return k.linear_bf16(h, w) * 2, ids, weights

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(x), step(x)):
        assert torch.equal(got, want)


def test_an_operator_releases_the_gil_while_it_computes(tier):
    """A Python thread runs while one kernel call computes (what the store's loader threads rely on). The GIL changes
    hands only when a thread lets it go (a long switch interval; the other thread yields it each turn), so the
    thread counts during the call only if the call released it."""
    k = cpu_kernels.extension()
    x = torch.ones(1 << 26, dtype=torch.uint8)  # 64 MiB: milliseconds to read
    ticks, started, done = [0], threading.Event(), threading.Event()

    def count() -> None:
        started.set()
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    thread = threading.Thread(target=count)
    try:
        thread.start()
        started.wait()
        counted = []
        for _ in range(3):
            before = ticks[0]
            k.stream_read(x)
            counted.append(ticks[0] - before)
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert max(counted) > 10, counted
