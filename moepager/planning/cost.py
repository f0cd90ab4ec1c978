"""A cost model for replayed traces: modeled time per decode token (TPOT) and per prefill (TTFT).

Per step and MoE layer, with n distinct experts requested, h of them cached, m = n - h loaded on demand:
  c = one expert's compute: max(weight bytes / memory bandwidth, tokens * 2 * params / FLOP/s) + launch
  l = one expert's load: bytes / link bandwidth + per-transfer latency
  overlap "none":  layer = other + n*c + m*l          (load, then compute, one expert at a time)
  overlap "layer": layer = other + max(n*c, l + m*c, m*l + c)
    (moepager's store: hits compute while the misses load back to back; each miss computes when it lands)
  misses on the CPU (SMoE): layer = other + max(h*c, m*c_cpu)   (GPU and CPU run their experts in parallel)
Prefetches (SMoE) use the link in the background; a step whose prefetch traffic outlasts its compute waits
for the rest. `other` is the per-layer non-expert time: shared experts plus `dense_bytes_per_layer` read at
memory speed (attention and norms are not in a trace; pass their size to include them).
Numbers are nominal datasheet peaks derated to what a copy or a GEMV reaches (efficiency factors below), and
for this machine what FACTS.md and benchmarks/offload_cpu.py measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Overlap = Literal["none", "layer"]


@dataclass(frozen=True)
class Device:
    name: str
    mem_Bps: float
    """Effective memory bandwidth for reading expert weights."""
    flops: float
    """Effective dense bf16 FLOP/s."""
    launch_s: float
    """Fixed cost per expert computed (kernel launches, thread-pool dispatch)."""


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_s: float
    latency_s: float


_EFF_MEM, _EFF_FLOPS = 0.8, 0.6
DEVICES = {
    "a6000": Device("RTX A6000", 768e9 * _EFF_MEM, 155e12 * _EFF_FLOPS, 10e-6),
    "a100": Device("A100 80GB SXM", 2039e9 * _EFF_MEM, 312e12 * _EFF_FLOPS, 8e-6),
    "h100": Device("H100 SXM", 3350e9 * _EFF_MEM, 989e12 * _EFF_FLOPS, 8e-6),
    "rtx4090": Device("RTX 4090", 1008e9 * _EFF_MEM, 165e12 * _EFF_FLOPS, 10e-6),
    # This machine, 2 threads, bf16 (FACTS.md: a Mixtral expert in 12.7 ms for 1 token, 39 ms for 64).
    "cpu": Device("2-core EPYC (this machine)", 27.7e9, 0.84e12, 50e-6),
}
LINKS = {
    # x16 host->device from pinned memory, about 80% of the nominal 15.8 / 31.5 / 63 GB/s.
    "pcie3": Link("PCIe 3.0 x16", 12.5e9, 10e-6),
    "pcie4": Link("PCIe 4.0 x16", 25e9, 10e-6),
    "pcie5": Link("PCIe 5.0 x16", 50e9, 10e-6),
    # This machine's virtio disk, O_DIRECT reads (benchmarks/offload_cpu.py: 2.6 GB/s median raw).
    "disk": Link("virtio disk (this machine)", 2.6e9, 100e-6),
}
PROFILES = {"a6000-pcie4": ("a6000", "pcie4"), "a100-pcie4": ("a100", "pcie4"), "h100-pcie5": ("h100", "pcie5"),
            "rtx4090-pcie4": ("rtx4090", "pcie4"), "h100-pcie3": ("h100", "pcie3"), "cpu-disk": ("cpu", "disk")}


@dataclass(frozen=True)
class CostModel:
    device: Device
    link: Link
    expert_bytes: int
    num_shared: int = 0
    dense_bytes_per_layer: int = 0
    overlap: Overlap = "layer"

    @classmethod
    def profile(cls, name: str, expert_bytes: int, **kw: object) -> CostModel:
        if name not in PROFILES:
            raise ValueError(f"unknown hardware profile '{name}'; choose from {sorted(PROFILES)}")
        if expert_bytes <= 0:
            raise ValueError("the cost model needs the bytes per expert (the trace header has none: --expert-bytes)")
        device, link = PROFILES[name]
        return cls(DEVICES[device], LINKS[link], expert_bytes, **kw)  # type: ignore[arg-type]

    def compute_s(self, tokens_per_expert: np.ndarray | float, device: Device | None = None) -> np.ndarray:
        d = device or self.device
        flops = np.asarray(tokens_per_expert, np.float64) * 2 * (self.expert_bytes / 2)  # bf16: 2 bytes/param
        return np.maximum(self.expert_bytes / d.mem_Bps, flops / d.flops) + d.launch_s

    def step_times(self, requested_SL: np.ndarray, hits_SL: np.ndarray, prefetch_SL: np.ndarray,
                   tokens_S: np.ndarray, top_k: int, misses_on_cpu: bool) -> np.ndarray:
        """Modeled seconds per step."""
        n, h = requested_SL.astype(np.float64), hits_SL.astype(np.float64)
        m = n - h
        per_expert_tokens = tokens_S[:, None] * top_k / np.maximum(n, 1)
        c = self.compute_s(per_expert_tokens)
        other = self.num_shared * self.compute_s(tokens_S[:, None]) + self.dense_bytes_per_layer / self.device.mem_Bps
        load = self.expert_bytes / self.link.bytes_per_s + self.link.latency_s
        if misses_on_cpu:
            layer = other + np.maximum(h * c, m * self.compute_s(per_expert_tokens, DEVICES["cpu"]))
        elif self.overlap == "none":
            layer = other + n * c + m * load
        else:  # every miss is loaded, admitted or streamed through
            loaded = np.maximum(load + m * c, m * load + c)
            layer = other + np.where(m > 0, np.maximum(n * c, loaded), n * c)
        compute = layer.sum(1)
        background = prefetch_SL.sum(1) * load
        return compute + np.maximum(0.0, background - compute)
