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
import psutil, torch
from moepager.store import budget

def churn():
    big, kept = [], []
    for _ in range(64):  # 2 MiB buffers, each followed by a small allocation that stays (a weight kept)
        big.append(torch.ones(1 << 19))
        kept.append(torch.ones(64))
    before = psutil.Process().memory_info().rss
    del big
    return before - psutil.Process().memory_info().rss

budget.mallopt()(budget.M_MMAP_THRESHOLD, budget.RUN_MMAP_THRESHOLD)  # as glibc's default is after large frees
kept = churn()
with budget.heap_for_loading() as tuned:
    left = churn()
print(kept, left, tuned)
"""
"""A fresh process (a long-lived one's heap has free chunks that any allocation reuses, mapped or not): the RSS that
64 freed 2 MiB buffers leave, in the run's heap state and inside `heap_for_loading`."""


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
    out = subprocess.run([sys.executable, "-c", CHURN], capture_output=True, text=True, env=env, check=True).stdout
    kept, left, tuned = out.split()
    assert int(kept) < 16 << 20 and int(left) >= 100 << 20 and tuned == "True"  # of 128 MiB freed
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
