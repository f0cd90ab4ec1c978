"""Memory budgets: "6GiB", "1.5G", "800MB", "25%" (of all routed experts), "all" -> a number of expert slots.

Binary units (KiB/MiB/GiB/TiB and the bare K/M/G/T) are powers of 1024; KB/MB/GB/TB are powers of 1000.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moepager.errors import BudgetError

UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
         "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z%]*)\s*$")


@dataclass(frozen=True)
class Budget:
    """A parsed budget: either a byte count or a fraction of all experts (exactly one is set)."""

    nbytes: int | None = None
    fraction: float | None = None
    text: str = ""

    @classmethod
    def parse(cls, text: str, flag: str = "budget") -> Budget:
        if text.strip().lower() == "all":
            return cls(fraction=1.0, text=text)
        m = _PATTERN.match(text.lower())
        if m is None or (m.group(2) not in UNITS and m.group(2) != "%"):
            raise BudgetError(f"{flag} '{text}' is not a size: use e.g. 6GiB, 800MB, 25% or all")
        value, unit = float(m.group(1)), m.group(2)
        if unit == "%":
            if not 0 < value <= 100:
                raise BudgetError(f"{flag} '{text}' must be a percentage in (0, 100]")
            return cls(fraction=value / 100, text=text)
        return cls(nbytes=int(value * UNITS[unit]), text=text)

    def slots(self, expert_nbytes: int, total_experts: int, reserved_bytes: int = 0) -> int:
        """How many whole experts fit beside `reserved_bytes` of buffers, capped at all experts. A share (25%)
        is that share of all experts' bytes; `all` is every expert whatever the buffers."""
        if self.fraction == 1.0:
            return total_experts
        nbytes = self.nbytes if self.nbytes is not None else int(self.fraction * total_experts * expert_nbytes + 0.5)
        return max(0, min((nbytes - reserved_bytes) // expert_nbytes, total_experts))


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
