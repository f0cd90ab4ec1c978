"""Budget strings -> expert slots, and the minimum check."""

from __future__ import annotations

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
