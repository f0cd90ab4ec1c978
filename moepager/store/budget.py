"""What a budget holds, checked against the least a decode step needs; the memory a run may use (within a
container's limit); byte counts for people.

The budget grammar itself ("6GiB", "25%", "all") is configuration: `moepager.config.Budget`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import psutil

from moepager.config import Budget
from moepager.errors import BudgetError

ENV_AVAILABLE = "MOEPAGER_MEMORY_AVAILABLE"
"""A size ("6GiB", "800MB"): the memory a run may use, in place of what the machine reports (to leave room for other
programs, or to try a fit as a smaller machine would make it)."""
_UNLIMITED = 1 << 60
"""A cgroup `memory.max` of "max" (or v1's page-rounded 2^63): no limit."""


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


def share_quotas(budgets: Sequence[float], capacity: int, least: Sequence[int], most: Sequence[int]) -> list[int]:
    """`capacity` cache slots shared between layers in proportion to `budgets` (MoEpic's per-layer V_i), none above
    what layer i can cache (`most[i]`) and none below `least[i]` where the capacity allows (what a decode step holds
    at once: a layer's top-k; the simulator's per-layer capacities have the same floor); slots no layer can use stay
    with the layers furthest below their share."""
    layers = len(budgets)
    floor = list(least) if capacity >= sum(least) else [capacity // layers] * layers
    share = [capacity * b / sum(budgets) for b in budgets]
    want = [max(0.0, x - f) for x, f in zip(share, floor)]  # what each layer's share asks beyond its least
    rest = capacity - sum(floor)
    quotas = [f + max(0, min(int(rest * w / sum(want)) if sum(want) else 0, m - f))
              for w, f, m in zip(want, floor, most)]
    while sum(quotas) < capacity:  # the rest one at a time, to the layers furthest below their share
        room = [i for i in range(layers) if quotas[i] < most[i]] or list(range(layers))
        quotas[max(room, key=lambda i: (share[i] - quotas[i], -i))] += 1
    return quotas


def cgroup_room(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc/self/cgroup")) -> int | None:
    """What this process's cgroup still allows (its memory limit less its usage), or None without a limit."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.lstrip("/")
        if hierarchy == "0" and controllers == "":  # v2: one unified hierarchy
            limit, usage = root / rel / "memory.max", root / rel / "memory.current"
        elif "memory" in controllers.split(","):  # v1
            folder = root / "memory" / rel
            limit, usage = folder / "memory.limit_in_bytes", folder / "memory.usage_in_bytes"
        else:
            continue
        try:
            text = limit.read_text().strip()
            if text == "max" or int(text) >= _UNLIMITED:
                return None
            return max(0, int(text) - int(usage.read_text().strip()))
        except (OSError, ValueError):
            return None
    return None


def mapped_libraries(status: Path = Path("/proc/self/status")) -> int:
    """The shared libraries mapped into this process (VmLib, bytes; 0 where unknown). Their pages count in its RSS as
    it touches them, yet the machine reports them available (page cache) and a cgroup charges them to whichever
    cgroup first read them, so neither figure sees them as this run's: the available memory is taken less them."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmLib:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's `mallopt` parameters (malloc.h)."""
LOAD_MMAP_THRESHOLD = 1 << 20
"""While a model loads, every C allocation of this size or more is a mapping of its own, unmapped when freed."""
RUN_MMAP_THRESHOLD = 32 << 20
"""After the load: glibc's own ceiling for its sliding threshold (64-bit), with the trim threshold it pairs with it
(twice), the state its default reaches once large buffers have come and gone, as a run's steps make them."""
TUNED_BY_USER = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
"""glibc's own environment variables: set, the heap is left as the user tuned it."""


def mallopt() -> Callable[[int, int], int] | None:
    """glibc's `mallopt(param, value)` (None: another C library, or one without it)."""
    name = ctypes.util.find_library("c")
    try:
        call = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return None
    if call is not None:
        call.argtypes, call.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return call


@contextmanager
def heap_for_loading() -> Iterator[bool]:
    """A load's C heap: its large buffers (a weight read and cast, a repack, a reader's scratch) are mappings of their
    own (LOAD_MMAP_THRESHOLD) and leave the process when freed, instead of staying in heaps pinned by the weights
    kept around them. glibc's default moves its threshold up to the largest buffer freed, so a load otherwise left a
    fraction of a GiB of freed heap in its RSS, memory the fit counts as the experts' and the working memory's
    (benchmarks/README.md, bigger_than_ram). Afterwards the threshold is where glibc's default ends
    (RUN_MMAP_THRESHOLD), so a step's activations come from the heap as before. Yields whether the heap was tuned:
    not where the C library is not glibc, nor where the user set glibc's variables."""
    call = None if any(v in os.environ for v in TUNED_BY_USER) else mallopt()
    if call is not None:
        call(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)
    try:
        yield call is not None
    finally:
        if call is not None:
            call(M_MMAP_THRESHOLD, RUN_MMAP_THRESHOLD)
            call(M_TRIM_THRESHOLD, 2 * RUN_MMAP_THRESHOLD)


def ram_available() -> tuple[int, str]:
    """The RAM this run may use, and where the figure came from."""
    if os.environ.get(ENV_AVAILABLE):
        budget = Budget.parse(os.environ[ENV_AVAILABLE], ENV_AVAILABLE)
        if budget.nbytes is None:
            raise BudgetError(f"{ENV_AVAILABLE} '{budget.text}' must be a size (e.g. 6GiB), not a share")
        return budget.nbytes, f"({ENV_AVAILABLE})"
    libraries = mapped_libraries()
    less = f" less {format_bytes(libraries)} of shared libraries mapped here" if libraries else ""
    available = psutil.virtual_memory().available
    room = cgroup_room()
    if room is not None and room < available:
        return max(room - libraries, 0), f"(the cgroup's memory limit less its usage{less})"
    return max(available - libraries, 0), f"available{less}"
