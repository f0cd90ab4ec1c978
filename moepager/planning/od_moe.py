"""OD-MoE's decode pipeline on paper (OD-MoE §2.3-2.4): how fast N worker machines would decode a trace, so that a
deployment can be sized before it is bought (`moepager simulate --workers N`).

Per decode step and MoE layer, with n distinct experts routed (from the trace) shared by the G workers of the layer's
group, the busiest worker of the group computing `share` of them one after another (ceil(n / G) with one-to-one
assignment, OD-MoE's; with fixed assignment the most that share one home, from the trace: `worker_shares`, the
engine's own `Placement.ranks_of`, so the model and the engine assign every call alike) and N / G groups taking layers
in turn:
  hop      = tokens * hidden bytes / network bandwidth + latency        (hidden states to the group, outputs back)
  t_W      = share * (one expert's compute on a worker's device)
  load     = expert bytes / a worker's link + latency                    (host memory -> its GPU, just in time)
  maxload  = (N / G) * (t_M + 2 hop) + (N / G - 1) * t_W                 (§2.4: the time a group has to load a layer
                                                                          predicted correctly before its turn)
  stall    = max(0, r * share * load - maxload) + (1 - r) * share * load
             (the predicted share loads ahead, what overruns maxload stalls; the mispredicted share, a fraction 1 - r
              by the shadow's recall r, loads after the layer's routing is known)
  layer    = t_M + 2 hop + t_W + stall
where t_M is the main node's per-layer time (attention, gating, norms). Cacheless, as OD-MoE runs: every routed expert
is loaded for every layer call. With worker caches (`--worker-cache C`, the engine's `--worker-memory`), only the m of
the n routed experts a group's caches miss are loaded (the loads and the stall take ceil(m / G) with one-to-one
assignment, and with fixed an estimate, the busiest worker's share scaled by m / n but no less than ceil(m / G); the
compute still `share`); `group_cache` sizes the cache the simulator replays for that. Against it, all in one GPU's
memory: layer = t_M + n * (one expert's compute).

A prompt (§2.7; `prefill_times`): no prediction, every routed expert loaded on demand. Per prompt chunk and MoE layer
each worker loads the routed experts a prefill pass gives it (`Placement.ranks_of(..., "prefill")`: with a spread
prefill expert e on worker e mod N of all N, otherwise the layer's group) and computes them, and the layer waits for the
busiest:
  layer = t_M + 2 hop + busiest * (load + compute)
with compute that of one expert on tokens * top-k / n tokens (the chunk's mean per routed expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moepager.errors import MoepagerError
from moepager.experts.remote.placement import Placement
from moepager.planning.cost import Device, Link
from moepager.types import Phase


@dataclass(frozen=True)
class Cluster:
    """A deployment: N workers in groups of G, each with its own GPU and host link, a LAN to the main node, the main
    node's per-layer time and the shadow's recall."""

    workers: int
    group_size: int
    worker: Device
    worker_link: Link
    network: Link
    main_layer_s: float
    """t_M: the main node's time for one layer's attention, gating and norms at one token."""
    recall: float
    """r: the share of a layer's routed experts the shadow predicted (0: no shadow, every load on demand)."""

    def __post_init__(self) -> None:
        if self.workers < 1 or not 1 <= self.group_size <= self.workers:
            raise MoepagerError(f"a worker group of {self.group_size} needs 1 to {self.workers} workers")
        if not 0 <= self.recall <= 1:
            raise MoepagerError(f"the shadow's recall is a share between 0 and 1, got {self.recall}")


def expert_compute_s(device: Device, expert_bytes: int, tokens: np.ndarray) -> np.ndarray:
    """One expert on `device` for `tokens` tokens: its weights' read or its FLOPs, whichever is longer (bf16)."""
    flops = tokens * 2 * (expert_bytes / 2)
    return np.maximum(expert_bytes / device.mem_Bps, flops / device.flops) + device.launch_s


def group_cache(cluster: Cluster, num_layers: int, num_experts: int, worker_cache: int) -> int:
    """The per-layer cache a layer's group holds when each worker keeps `worker_cache` experts of its own across steps:
    a worker holds its share of each of the layers its group serves (L / (N / G) of them, round-robin), so its cache
    splits over those layers, and a layer's experts live on the G workers of its group (each on one), whose shares add
    up (capped at the layer's experts)."""
    groups = cluster.workers // cluster.group_size
    layers_per_group = -(-num_layers // groups)
    return min(num_experts, cluster.group_size * worker_cache // layers_per_group)


def worker_shares(routed_SLE: np.ndarray, placement: Placement, phase: Phase = "decode") -> np.ndarray:
    """The most of each step's routed experts of each layer that one worker computes, [steps, layers], assigned as
    the engine assigns them in a pass of `phase` (`Placement.ranks_of`; the trace's layer index is the MoE layer's
    position)."""
    steps, layers, _ = routed_SLE.shape
    out = np.zeros((steps, layers), np.int64)
    for s in range(steps):
        for layer in range(layers):
            experts = np.flatnonzero(routed_SLE[s, layer]).tolist()
            if experts:
                ranks = placement.ranks_of(layer, experts, phase)
                out[s, layer] = max(ranks.count(r) for r in set(ranks))
    return out


def crowded_calls(share_SL: np.ndarray, requested_SL: np.ndarray, group_size: int) -> float:
    """The share of layer calls (those that route to any expert) in which the busiest worker took more than
    ceil(n / G) of the call's n experts (`share_SL`: `worker_shares`)."""
    routed = requested_SL > 0
    return float(np.mean(share_SL[routed] > np.ceil(requested_SL[routed] / group_size)))


def step_times(cluster: Cluster, requested_SL: np.ndarray, tokens_S: np.ndarray, expert_bytes: int,
               hidden_bytes: int, top_k: int, loaded_SL: np.ndarray | None = None,
               share_SL: np.ndarray | None = None) -> np.ndarray:
    """Modeled seconds of each step (module note). `requested_SL`: distinct experts each step routed per layer;
    `loaded_SL`: those of them the workers load (default all: cacheless); `hidden_bytes`: one token's hidden state on
    the wire; `share_SL`: the busiest worker's count of them (`worker_shares`; default ceil(n / G), one-to-one)."""
    n = requested_SL.astype(np.float64)
    tokens = tokens_S.astype(np.float64)[:, None]
    g = cluster.group_size
    share = np.ceil(n / g) if share_SL is None else share_SL.astype(np.float64)
    if loaded_SL is None:
        loads = share
    else:
        m = loaded_SL.astype(np.float64)
        loads = np.ceil(m / g) if share_SL is None else \
            np.minimum(share, np.maximum(np.ceil(m / g), np.ceil(share * m / np.maximum(n, 1) - 1e-9)))
    groups = cluster.workers // cluster.group_size
    c, hop, load = _layer_terms(cluster, n, tokens, expert_bytes, hidden_bytes, top_k)
    t_w = share * c
    t_m = cluster.main_layer_s
    maxload = groups * (t_m + 2 * hop) + (groups - 1) * t_w
    stall = np.maximum(0.0, cluster.recall * loads * load - maxload) + (1 - cluster.recall) * loads * load
    return (t_m + 2 * hop + t_w + stall).sum(1)


def _layer_terms(cluster: Cluster, n: np.ndarray, tokens: np.ndarray, expert_bytes: int, hidden_bytes: int,
                 top_k: int) -> tuple[np.ndarray, np.ndarray, float]:
    """A layer call's terms (module note): one routed expert's compute on its mean tokens, the hop, one expert's
    load."""
    c = expert_compute_s(cluster.worker, expert_bytes, tokens * top_k / np.maximum(n, 1))
    hop = tokens * hidden_bytes / cluster.network.bytes_per_s + cluster.network.latency_s
    return c, hop, expert_bytes / cluster.worker_link.bytes_per_s + cluster.worker_link.latency_s


def prefill_times(cluster: Cluster, requested_SL: np.ndarray, tokens_S: np.ndarray, expert_bytes: int,
                  hidden_bytes: int, top_k: int, share_SL: np.ndarray) -> np.ndarray:
    """Modeled seconds of each prompt chunk (module note, "A prompt"); `share_SL`: the busiest worker's routed experts
    in each layer call (`worker_shares(..., "prefill")`)."""
    c, hop, load = _layer_terms(cluster, requested_SL.astype(np.float64), tokens_S.astype(np.float64)[:, None],
                                expert_bytes, hidden_bytes, top_k)
    return (cluster.main_layer_s + 2 * hop + share_SL * (load + c)).sum(1)


def resident_step_times(device: Device, main_layer_s: float, requested_SL: np.ndarray, tokens_S: np.ndarray,
                        expert_bytes: int, top_k: int) -> np.ndarray:
    """The same steps with every expert in one GPU's memory (OD-MoE's all-in-GPU reference)."""
    n = requested_SL.astype(np.float64)
    tokens = tokens_S.astype(np.float64)[:, None]
    c = expert_compute_s(device, expert_bytes, tokens * top_k / np.maximum(n, 1))
    return (main_layer_s + n * c).sum(1)
