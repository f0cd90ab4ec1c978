"""The slow reference simulator: one access at a time through the engine-side policy protocol.

It is what tests compare the vectorised simulator against (same policies, same semantics, no arrays).
"""

from __future__ import annotations

import numpy as np

from moepager.policies import make_policy
from moepager.trace.format import MISSING
from moepager.trace.simulate import drive_of
from moepager.trace.workload import Workload
from moepager.types import ExpertKey


def reference_hits(work: Workload, name: str, capacity: int, scope: str,
                   prior_LE: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(requested_SL, hits_SL) replaying every access through on_access / victim."""
    policy, drive = make_policy(name), drive_of(name)
    num_layers = work.header.num_layers
    next_use = work.next_use_NLK() if drive.offline else None
    cached: set[ExpertKey] = set()
    if prior_LE is not None:
        for layer in range(num_layers):
            for e in range(work.header.num_experts):
                slot = policy._row(ExpertKey(layer, e))  # may grow the arrays: index after
                policy.stats.prior[slot] = prior_LE[layer, e]
        if drive.preload and scope == "global":
            flat = np.argsort(-prior_LE.ravel(), kind="stable")[:capacity]
            cached |= {ExpertKey(*map(int, divmod(i, work.header.num_experts))) for i in flat}
        elif drive.preload:
            for layer in range(num_layers):
                order = np.argsort(-prior_LE[layer], kind="stable")[:capacity]
                cached |= {ExpertKey(layer, int(e)) for e in order}
    requested = np.zeros((work.num_steps, num_layers), np.int32)
    hits = np.zeros_like(requested)
    for s in range(work.num_steps):
        toks = work.step_tokens[work.step_ptr[s]:work.step_ptr[s + 1]]
        for layer in range(num_layers):
            ids = work.ids_NLK[toks, layer]
            want = sorted({int(e) for e in ids.ravel() if e != MISSING})
            keys = [ExpertKey(layer, e) for e in want]
            for key in keys:
                policy.on_access([key], s)
                if next_use is not None:
                    where = np.argwhere(ids == key.expert)[0]
                    slot = policy._row(key)
                    policy.stats.next_use[slot] = next_use[toks[where[0]], layer, where[1]]
            requested[s, layer] = len(keys)
            hits[s, layer] = sum(k in cached for k in keys)
            for key in keys:
                if key in cached:
                    continue
                pool = [k for k in cached if scope == "global" or k.layer == layer]
                if len(pool) >= capacity:
                    candidates = [k for k in pool if k not in keys]
                    if not candidates:
                        break
                    cached.discard(policy.victim(candidates, s))
                cached.add(key)
    return requested, hits
