"""Split experts in the trace simulator: what a run of a `moepager split` checkpoint moves (MoEpic's split).

A layer caching the top t_l of each expert's S parts requests, for every expert a step routes to, its t_l top parts
through the layer's cache (capacity in parts) and loads its S - t_l bottom parts always. `split_workload` renumbers
each routed expert e of layer l into its top parts e·t_l + j (j < t_l): ascending as the engine's part keys e·S + j
are, and in a warm start's order (the engine warms each layer's cacheable parts in ascending key order, the simulator
ids 0..capacity-1), so the simulator's hits and misses on the tops are the engine's (tests/checkpoints/test_split.py);
`simulate_split` adds the bottoms as demand loads. Counts are in parts (1/S of an expert's bytes each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from moepager.trace.format import MISSING
from moepager.trace.simulate import SimResult, SimSpec, simulate
from moepager.trace.workload import Workload


def split_workload(work: Workload, parts: int, tops: Sequence[int]) -> Workload:
    """`work` with each routed expert replaced by its top parts (layer l: `tops[l]` of `parts`); ids e·t_l + j."""
    n, num_layers, k = work.ids_NLK.shape
    if len(tops) != num_layers or not all(1 <= t <= parts for t in tops):
        raise ValueError(f"top parts {list(tops)} must give each of the {num_layers} layers 1..{parts}")
    width = max(tops)
    ids = np.full((n, num_layers, k * width), MISSING, np.int64)
    for layer, t in enumerate(tops):
        e = work.ids_NLK[:, layer, :].astype(np.int64)
        split = e[:, :, None] * t + np.arange(t)[None, None, :]
        ids[:, layer, : k * t] = np.where(e[:, :, None] == MISSING, MISSING, split).reshape(n, k * t)
    header = replace(work.header, num_experts=work.header.num_experts * parts, top_k=work.header.top_k * width,
                     expert_bytes=work.header.expert_bytes // parts if work.header.expert_bytes else 0)
    return replace(work, header=header, ids_NLK=ids.astype(np.int32))


def simulate_split(work: Workload, spec: SimSpec, parts: int, tops: Sequence[int]) -> SimResult:
    """Replay `work` on split experts: the tops through the caches of `spec` (capacities in parts), every bottom part
    loaded on demand. Counts are in parts."""
    result = simulate(split_workload(work, parts, tops), spec)
    t_L = np.asarray(tops)
    experts_SL = result.requested_SL // t_L  # each routed expert requests exactly t_l top parts
    bottoms_SL = experts_SL * (parts - t_L)
    return replace(result, requested_SL=result.requested_SL + bottoms_SL,
                   demand_loads_SL=result.demand_loads_SL + bottoms_SL)
