"""Batch policies: which decoding requests rest this step (runtime/scheduler.py asks; the scheduler's own algorithm,
FIFO admission and preemption, is the same under every policy). One file each, one registry line each:
- `fifo` (fifo.py): nobody rests; at most max_num_seqs requests run;
- `expertflow` (expertflow.py): ExpertFlow's token scheduler, two resident batches grouped by routing path.
"""

from __future__ import annotations

from moepager.config import BatchPolicy as BatchPolicyName
from moepager.config import SchedulerConfig
from moepager.runtime.batch_policy.base import BatchPolicy, RoutingPaths
from moepager.runtime.batch_policy.expertflow import ExpertFlowPolicy
from moepager.runtime.batch_policy.fifo import FifoPolicy

BATCH_POLICY_TYPES: dict[BatchPolicyName, type[FifoPolicy | ExpertFlowPolicy]] = {
    "fifo": FifoPolicy,
    "expertflow": ExpertFlowPolicy,
}
"""--batch-policy NAME -> its policy, built from the scheduler's configuration and the requests' routing paths."""


def needs_paths(config: SchedulerConfig) -> bool:
    """Whether the policy reads the requests' routing paths (the composition root feeds a `PathTracker` to those
    alone)."""
    return BATCH_POLICY_TYPES[config.batch_policy].needs_paths


def batch_policy(config: SchedulerConfig, paths: RoutingPaths | None = None) -> BatchPolicy:
    """The policy `config.batch_policy` names."""
    return BATCH_POLICY_TYPES[config.batch_policy](config, paths)
