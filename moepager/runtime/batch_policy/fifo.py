"""The batch policy `fifo`: every running request steps; at most max_num_seqs run."""

from __future__ import annotations

from collections.abc import Sequence

from moepager.config import SchedulerConfig
from moepager.runtime.batch_policy.base import RoutingPaths
from moepager.runtime.request import QueuedRequest


class FifoPolicy:
    running_factor = 1
    rests = False
    needs_paths = False

    def __init__(self, config: SchedulerConfig, paths: RoutingPaths | None = None):
        """(`paths` unread: FIFO knows no routing.)"""

    def resting(self, running: Sequence[QueuedRequest]) -> set[int]:
        return set()

    def forget(self, request_id: int) -> None:
        pass

    def close(self) -> None:
        pass
