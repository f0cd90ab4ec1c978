"""Budget strings -> expert slots, and the minimum check."""

from __future__ import annotations

import os

import pytest

from moepager.config import Budget
from moepager.errors import BudgetError
from moepager.store.budget import check_slots


@pytest.mark.parametrize("text, nbytes", [("6GiB", 6 * 2**30), ("1.5G", int(1.5 * 2**30)), ("800MB", 800 * 10**6),
                                          ("512 MiB", 512 * 2**20), ("4096", 4096), ("2k", 2048), ("1TB", 10**12)])
def test_sizes(text, nbytes):
    assert Budget.parse(text).nbytes == nbytes


@pytest.mark.parametrize("text, slots", [("25%", 16), ("12.5%", 8), ("100%", 64), ("all", 64), ("0.1%", 0)])
def test_fractions_of_all_experts(text, slots):
    assert Budget.parse(text).slots(expert_nbytes=10, total_experts=64) == slots


def test_bytes_round_down_to_whole_experts_and_cap_at_all():
    assert Budget.parse("95").slots(10, 64) == 9
    assert Budget.parse("1GiB").slots(10, 64) == 64


@pytest.mark.parametrize("text", ["", "lots", "5 parsecs", "-3GiB", "150%", "0%", "1e9"])
def test_malformed_budgets_name_the_flag(text):
    with pytest.raises(BudgetError, match="--expert-memory"):
        Budget.parse(text, "--expert-memory")


def test_below_minimum_says_the_minimum():
    with pytest.raises(BudgetError, match=r"holds 3 experts, below the minimum of 8 .*= 8.00 MiB"):
        check_slots(3, 8, 2**20, "--expert-memory", "3MiB")


CHURN = """
import sys
import psutil, torch
from moepager.store import budget

def churn():
    big, kept = [], []
    for _ in range(64):  # 2 MiB buffers, each followed by a 256 KiB one that stays (a weight kept), too big for a hole
        big.append(torch.ones(1 << 19))
        kept.append(torch.ones(1 << 16))
    before = psutil.Process().memory_info().rss
    del big
    return before - psutil.Process().memory_info().rss

if sys.argv[1] == "tuned":
    with budget.heap_for_loading() as tuned:
        left = churn()
else:
    budget.mallopt()(budget.M_MMAP_THRESHOLD, budget.RUN_MMAP_THRESHOLD)  # as glibc's default is after large frees
    left, tuned = churn(), False
print(left, tuned)
"""
"""The RSS that 64 freed 2 MiB buffers leave, in the run's heap state or inside `heap_for_loading`. Each in a fresh
process: glibc reuses a free chunk that fits before it maps anything, so a heap that has churned once (a long-lived
process, or the other case run first) serves the buffers from its holes, mapped threshold or not."""


def test_a_load_s_freed_buffers_leave_the_process_and_the_heap_is_as_glibc_leaves_it_after(monkeypatch):
    """Inside `heap_for_loading` a large buffer freed between weights kept around it leaves the RSS (its own mapping);
    glibc's default heap keeps it. Where the user set glibc's variables, or the C library has no mallopt, nothing is
    tuned."""
    import subprocess
    import sys

    from moepager.store import budget

    if budget.mallopt() is None:
        pytest.skip("the C library is not glibc: nothing to tune")
    env = {k: v for k, v in os.environ.items() if k not in budget.TUNED_BY_USER}
    def left(case):
        out = subprocess.run([sys.executable, "-c", CHURN, case], capture_output=True, text=True, env=env, check=True)
        return out.stdout.split()

    left_tuned, tuned = left("tuned")
    assert int(left_tuned) >= 64 * (2 << 20) and tuned == "True"  # every byte freed left the process (and its headers)
    kept, tuned = left("default")
    assert int(kept) < 16 << 20 and tuned == "False"
    calls = []
    monkeypatch.setattr(budget, "mallopt", lambda: lambda param, value: calls.append((param, value)) or 1)
    with budget.heap_for_loading():
        assert calls == [(budget.M_MMAP_THRESHOLD, 1 << 20)]
    assert calls[1:] == [(budget.M_MMAP_THRESHOLD, 32 << 20), (budget.M_TRIM_THRESHOLD, 64 << 20)]
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    calls.clear()
    with budget.heap_for_loading() as tuned:
        assert not tuned
    assert calls == []
