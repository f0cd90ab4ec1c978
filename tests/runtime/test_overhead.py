"""Overhead counts of a decode step on the built-in model (6 MoE layers, top-4): moepager-level Python calls per
decode token, the difference of a 17-token and a 1-token generation over 16 steps (runtime/profiling.py). Resident,
the count is exact. Paged, it depends on how many loads have landed when a layer looks; here every transfer has
landed when it is submitted (reads still run on their I/O threads, where the count does not look), so the paged
counts are exact too, the same on every machine. The bounds sit just above the counts, so that a change which adds
per-token work shows up here; `python -m benchmarks run overhead` measures with real transfers and times it."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import pytest

import moepager.placements.stores as stores
from moepager.config import EngineConfig, PrefetchConfig, StoreConfig
from moepager.runtime.llm import LLM
from moepager.runtime.profiling import calls_per_decode_token
from moepager.store.transfer import Transfers

PAGED = StoreConfig(expert_memory="25%", direct_io="off")


class _Landed(ThreadPoolExecutor):
    """Each read runs on its I/O thread as usual (where the count does not look) and has landed when `submit`
    returns, so every layer finds the same loads done at the same point whatever the machine's speed."""

    def submit(self, fn, /, *args, **kwargs) -> Future:  # noqa: ANN001 - Executor.submit's signature
        future = super().submit(fn, *args, **kwargs)
        future.exception()  # wait for it to land (a failed read is raised where the store waits, as always)
        return future


class LandedTransfers(Transfers):
    def __init__(self, *args, **kwargs):  # noqa: ANN002, ANN003 - Transfers' own
        super().__init__(*args, **kwargs)
        self.pool.shutdown()
        self.ahead_pool.shutdown()
        self.pool, self.ahead_pool = _Landed(1, "moepager-io"), _Landed(1, "moepager-prefetch")


@pytest.fixture
def landed(monkeypatch):
    """Paged runs whose every transfer has landed when submitted: the call counts below are exact."""
    monkeypatch.setattr(stores, "Transfers", LandedTransfers)


@pytest.mark.parametrize("config, bound", [
    (EngineConfig(), 140),
    # paged: +1 a layer since the landing loop the hybrid executor shares is a call of its own, +1 a step for the
    # runner's pass split the simulator shares
    (EngineConfig(store=PAGED), 256),
    # (with moepager's CPU kernels: +12 frames a token for the dense projections' FusedLinear, each replacing a
    # ~15 us oneDNN call by a ~2 us GEMV; -12 for the fused expert layers)
    (EngineConfig(store=PAGED, prefetch=PrefetchConfig("gate-lookahead")), 456),
    pytest.param(EngineConfig(store=PAGED, prefetch=PrefetchConfig("gate-lookahead"), compile=True), 390,
                 marks=pytest.mark.slow),
], ids=["resident", "paged-25%", "paged-25%-gate-lookahead", "paged-25%-gate-lookahead-compiled"])
def test_python_calls_per_decode_token_stay_bounded(config, bound, landed):
    llm = LLM(config=config, show_progress=False)
    assert calls_per_decode_token(llm) <= bound


@pytest.mark.slow  # a TorchInductor compile: tens of seconds on 2 cores
def test_the_compiled_decode_step_makes_at_most_40_calls_per_token():
    """The compiled step (`--compile`) is issue 15's resident goal: the engine core's scheduler, runner and
    sampler, the model's forward entering its graph, and the LM head after it."""
    llm = LLM(config=EngineConfig(compile=True), show_progress=False)
    assert calls_per_decode_token(llm) <= 40  # compiled while loading (LLM._compile_now)
