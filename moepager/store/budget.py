"""What a budget holds, checked against the least a decode step needs; byte counts for people.

The budget grammar itself ("6GiB", "25%", "all") is configuration: `moepager.config.Budget`.
"""

from __future__ import annotations

from moepager.errors import BudgetError


def format_bytes(nbytes: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def check_slots(slots: int, minimum: int, expert_nbytes: int, flag: str, text: str, reserved_bytes: int = 0) -> None:
    """Raise with the minimum when a budget holds fewer than `minimum` experts."""
    if slots < minimum:
        buffers = f" + {format_bytes(reserved_bytes)} of read buffers" if reserved_bytes else ""
        raise BudgetError(f"{flag} {text} holds {slots} experts, below the minimum of {minimum} (one MoE layer's "
                          f"top-k = {format_bytes(minimum * expert_nbytes)}{buffers}); raise {flag}")
