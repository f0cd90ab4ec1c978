"""What a batch policy is to the scheduler (`BatchPolicy`), and what it may read of the requests' routing
(`RoutingPaths`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from moepager.runtime.request import QueuedRequest


class RoutingPaths(Protocol):
    """Each running request's routing path, a bit per (MoE layer, expert) (expertflow.py `PathTracker`, or the
    simulator's from a trace: runtime/step_order.py)."""

    column: dict[int, int]
    num_experts: int

    def path(self, request: int) -> np.ndarray | None: ...

    def update(self, decoding: Sequence[QueuedRequest]) -> None:
        """Groups are about to be formed over `decoding` (a tracker that forecasts from the next tokens does it)."""
        ...

    def forget(self, request: int) -> None: ...


class BatchPolicy(Protocol):
    running_factor: int
    """How many times max_num_seqs requests may run at once (resident in the KV cache)."""
    rests: bool
    """Whether it may rest anyone (False: the scheduler never asks, no call per step)."""
    needs_paths: bool
    """Whether it reads the requests' routing paths (`RoutingPaths`)."""

    def resting(self, running: Sequence[QueuedRequest]) -> set[int]:
        """The ids of the decoding requests among `running` that sit this step out."""
        ...

    def forget(self, request_id: int) -> None:
        """The request finished or was aborted."""
        ...

    def close(self) -> None:
        """Stop any thread of its own (the engine closes)."""
        ...
