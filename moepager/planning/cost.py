"""A cost model for replayed traces: modeled time per decode token (TPOT) and per prefill (TTFT).

Per step and MoE layer, with n distinct experts requested, h of them cached, m = n - h loaded on demand:
  c = one expert's compute: max(weight bytes / memory bandwidth, tokens * 2 * params / FLOP/s) + launch
  l = one expert's load: bytes / link bandwidth + per-transfer latency
  overlap "none":  layer = other + n*c + m*l          (load, then compute, one expert at a time)
  overlap "layer": layer = other + max(n*c, l + m*c, l + (m-1)*bytes/bandwidth + c)
    (moepager's store: a layer's misses are issued together, so the first lands after l and the rest follow
    at the link's aggregate rate, the latency overlapping; hits compute meanwhile and each miss computes when
    it lands)
  misses on the CPU (SMoE): layer = other + max(h*c, m*c_cpu)   (GPU and CPU run their experts in parallel)
  hybrid execution: m_cpu of the misses on the CPU, the rest loaded: layer = other + max(device part over
    h + m_dev experts as above, m_cpu*c_cpu); c_cpu is calibrated where the profile measured it
Prefetches (SMoE) use the link in the background; a step whose prefetch traffic outlasts its compute waits
for the rest. `other` is the per-layer non-expert time: shared experts plus `dense_bytes_per_layer` read at
memory speed (attention and norms are not in a trace; pass their size to include them).
Numbers are nominal datasheet peaks derated to what a copy or a GEMV reaches (efficiency factors below), and
for this machine what FACTS.md and benchmarks/offload_cpu.py measured.

Calibrated profiles (`moepager calibrate`, planning/calibrate.py) replace the nominal numbers with this
machine's measurements for one model: c(t) is interpolated between the measured expert times at 1 and 64
tokens (each includes the call's fixed overhead); the link is the measured disk (or host->device) rate and
latency for random experts; compute that runs while loads are in flight is slowed by the measured fraction
`io_slowdown` (on a small CPU reads share cores and memory with the GEMVs): within a layer, the compute that
overlaps the layer's loads (at most the time until its last load lands), and within a step the compute that
background prefetches overlap; a layer waiting on its loads hides its slowed compute; and each step pays the
model's measured non-expert time (attention, dense and shared MLPs, router, LM head) in place of `other`: a decode
step dense_decode + dense_kv * (KV length - the length it was measured at), since attention reads the whole cache;
a step of t > 1 tokens dense_decode + (t - 1) * dense_token.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from moepager.atomic_io import atomic_file
from moepager.errors import MoepagerError
from moepager.experts.hybrid import ExpertTimes

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
    "rtx3090": Device("RTX 3090", 936e9 * _EFF_MEM, 71e12 * _EFF_FLOPS, 10e-6),  # OD-MoE's nodes
    # A 2-core EPYC host of this project, 2 threads, bf16, fitted to a Mixtral expert's times at 1 and 64 tokens.
    "cpu": Device("2-core EPYC (this machine)", 27.7e9, 0.84e12, 50e-6),
}
LINKS = {
    # x16 host->device from pinned memory, about 80% of the nominal 15.8 / 31.5 / 63 GB/s.
    "pcie3": Link("PCIe 3.0 x16", 12.5e9, 10e-6),
    "pcie4": Link("PCIe 4.0 x16", 25e9, 10e-6),
    "pcie5": Link("PCIe 5.0 x16", 50e9, 10e-6),
    # OD-MoE's LAN between nodes, about 90% of 1 Gbps; its latency stands for a hop's serialising too (the paper
    # gives none).
    "1gbe": Link("1 Gbps Ethernet", 0.9 * 125e6, 0.5e-3),
    # This project's virtio disk, O_DIRECT reads (the median raw rate benchmarks/offload_cpu.py measured).
    "disk": Link("virtio disk (this machine)", 2.6e9, 100e-6),
}
PROFILES = {"a6000-pcie4": ("a6000", "pcie4"), "a100-pcie4": ("a100", "pcie4"), "h100-pcie5": ("h100", "pcie5"),
            "rtx4090-pcie4": ("rtx4090", "pcie4"), "h100-pcie3": ("h100", "pcie3"), "cpu-disk": ("cpu", "disk")}


@dataclass(frozen=True)
class Calibration:
    """One model's measured costs on one machine (planning/calibrate.py)."""

    expert_bytes: int
    expert_s_1: float
    """One routed expert's compute time for 1 token, weights from memory."""
    expert_s_64: float
    dense_decode_s: float
    """A decode step's non-expert time (attention, dense and shared MLPs, router, norms, LM head) at a KV
    cache of `dense_decode_kv` positions."""
    dense_decode_kv: float
    dense_kv_s: float
    """Further non-expert time of a decode step per cached position (attention reads the whole cache)."""
    dense_token_s: float
    """Non-expert time of each further token of a step (prefill)."""
    io_slowdown: float
    """How much slower compute runs while loads run beside it (0.3: 30% slower; CPU: shared cores and memory)."""
    model: str
    threads: int
    device: str
    cpu_expert_s_1: float | None = None
    """A CUDA calibration: one routed expert computed on the CPU for 1 token, weights in host memory (hybrid
    execution's other side); None where the device is the CPU (expert_s_1 is that) or the profile predates it."""
    cpu_expert_s_64: float | None = None

    def expert_s(self, tokens: np.ndarray) -> np.ndarray:
        slope = (self.expert_s_64 - self.expert_s_1) / 63
        return self.expert_s_1 + np.maximum(tokens - 1, 0) * max(slope, 0.0)

    def cpu_expert_s(self, tokens: np.ndarray) -> np.ndarray | None:
        """The CPU's time where measured (a CPU calibration's own expert time), else None."""
        if self.device == "cpu":
            return self.expert_s(tokens)
        if self.cpu_expert_s_1 is None or self.cpu_expert_s_64 is None:
            return None
        slope = (self.cpu_expert_s_64 - self.cpu_expert_s_1) / 63
        return self.cpu_expert_s_1 + np.maximum(tokens - 1, 0) * max(slope, 0.0)

    def dense_s(self, tokens_S: np.ndarray, kv_S: np.ndarray | None = None) -> np.ndarray:
        """Non-expert seconds of steps of `tokens_S` tokens ending at KV length `kv_S` (a prefill's own
        attention is inside dense_token_s; a decode step's grows with the cache)."""
        decode = self.dense_decode_s if kv_S is None else \
            np.maximum(self.dense_decode_s + (kv_S - self.dense_decode_kv) * self.dense_kv_s, 0.0)
        return np.where(tokens_S > 1, self.dense_decode_s + (tokens_S - 1) * self.dense_token_s, decode)


def nominal_profile(device_name: str) -> str:
    """The built-in profile nearest a device (torch.cuda.get_device_name, or "cpu"): the run's costs when no
    calibrated profile is given."""
    name = device_name.lower()
    if name == "cpu":
        return "cpu-disk"
    for key, profile in (("h100", "h100-pcie5"), ("h200", "h100-pcie5"), ("a100", "a100-pcie4"),
                         ("4090", "rtx4090-pcie4"), ("a6000", "a6000-pcie4")):
        if key in name:
            return profile
    return "a6000-pcie4"


PROFILE_KIND = "moepager-profile"
PROFILE_VERSION = 2
"""2: io_slowdown (a fraction of the compute that overlaps loads) replaced version 1's seconds lost per byte."""


@dataclass(frozen=True)
class CalibratedProfile:
    """A profile `moepager calibrate` wrote: the device and link it measured plus the model's calibration."""

    name: str
    device: Device
    link: Link
    calibration: Calibration
    measured: dict[str, float]
    """Every raw measurement, for the record."""

    def write(self, path: str | os.PathLike[str]) -> None:
        """Written to a temporary name beside `path`, then renamed (atomic_io.py): a reader never sees half a
        profile."""
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps({"kind": PROFILE_KIND, "version": PROFILE_VERSION, **asdict(self)}, indent=1)
                           + "\n")

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> CalibratedProfile:
        try:
            raw: dict[str, Any] = json.loads(Path(path).read_text())
            if raw.get("kind") != PROFILE_KIND:
                raise ValueError(f"not a moepager profile (version {PROFILE_VERSION})")
            if raw.get("version") != PROFILE_VERSION:
                raise ValueError(f"profile version {raw.get('version')}, written by an older moepager; this one "
                                 f"reads version {PROFILE_VERSION}")
            return cls(raw["name"], Device(**raw["device"]), Link(**raw["link"]), Calibration(**raw["calibration"]),
                       dict(raw["measured"]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MoepagerError(f"cannot read profile {path}: {e} (write one with `moepager calibrate --out`)") \
                from None


@dataclass(frozen=True)
class CostModel:
    device: Device
    link: Link
    expert_bytes: int
    num_shared: int = 0
    dense_bytes_per_layer: int = 0
    overlap: Overlap = "layer"
    calibration: Calibration | None = None
    """Measured expert and non-expert times for this geometry (replace the nominal formulas)."""

    @classmethod
    def profile(cls, name: str, expert_bytes: int, **kw: Any) -> CostModel:
        """A built-in profile by name, or a calibrated one from a JSON file (`moepager calibrate --out`)."""
        if name.endswith(".json") or Path(name).is_file():
            calibrated = CalibratedProfile.read(name)
            c = calibrated.calibration
            if expert_bytes and expert_bytes != c.expert_bytes:
                raise ValueError(f"profile {name} was calibrated for {c.expert_bytes}-byte experts ({c.model}); "
                                 f"this trace's are {expert_bytes} bytes: calibrate for a model of its geometry")
            # the calibration's non-expert time covers shared experts and dense weights
            kw = {**kw, "num_shared": 0, "dense_bytes_per_layer": 0}
            return cls(calibrated.device, calibrated.link, c.expert_bytes, calibration=c, **kw)
        if name not in PROFILES:
            raise ValueError(f"unknown hardware profile '{name}'; choose from {sorted(PROFILES)} or a profile JSON "
                             f"file written by `moepager calibrate`")
        if expert_bytes <= 0:
            raise ValueError("the cost model needs the bytes per expert (the trace header has none: --expert-bytes)")
        device, link = PROFILES[name]
        return cls(DEVICES[device], LINKS[link], expert_bytes, **kw)

    def compute_s(self, tokens_per_expert: np.ndarray | float, device: Device | None = None) -> np.ndarray:
        tokens = np.asarray(tokens_per_expert, np.float64)
        if self.calibration is not None and device is None:
            return self.calibration.expert_s(tokens)
        d = device or self.device
        flops = tokens * 2 * (self.expert_bytes / 2)  # bf16: 2 bytes/param
        return np.maximum(self.expert_bytes / d.mem_Bps, flops / d.flops) + d.launch_s

    def cpu_compute_s(self, tokens_per_expert: np.ndarray) -> np.ndarray:
        """One expert's compute on the CPU: calibrated where the profile measured it, else this project's CPU's
        nominal figures."""
        tokens = np.asarray(tokens_per_expert, np.float64)
        measured = None if self.calibration is None else self.calibration.cpu_expert_s(tokens)
        return measured if measured is not None else self.compute_s(tokens, DEVICES["cpu"])

    @property
    def device_is_cpu(self) -> bool:
        """The profile's device is a CPU (hybrid execution then has no other side to place an expert on)."""
        return self.device is DEVICES["cpu"] or (self.calibration is not None and self.calibration.device == "cpu")

    def expert_times(self, on_cpu: bool) -> ExpertTimes:
        """One expert's costs for hybrid placement (experts/hybrid.py): on the CPU (measured, else this project's
        CPU's nominal figures), on the device, and copied over the link (`on_cpu`: the device is the CPU itself, so
        both sides cost the same and no missing expert is worth a copy)."""
        n = np.array([1.0, 64.0])  # a line through 1 and 64 tokens, as calibrations measure
        device = self.compute_s(n)
        cpu = device if on_cpu else self.cpu_compute_s(n)
        copy = self.expert_bytes / self.link.bytes_per_s + self.link.latency_s
        return ExpertTimes(float(cpu[0]), float(cpu[1] - cpu[0]) / 63, float(device[0]),
                           float(device[1] - device[0]) / 63, copy)

    def step_times(self, requested_SL: np.ndarray, hits_SL: np.ndarray, prefetch_SL: np.ndarray,
                   tokens_S: np.ndarray, top_k: int, misses_on_cpu: bool, kv_S: np.ndarray | None = None,
                   cpu_SL: np.ndarray | None = None) -> np.ndarray:
        """Modeled seconds per step (`kv_S`: each step's KV length, for calibrated non-expert time). The misses
        computed on the CPU are every miss (`misses_on_cpu`, SMoE's policy) or `cpu_SL` (hybrid execution); the
        device computes the rest, the loaded ones as they land, while the CPU computes its share."""
        n, h = requested_SL.astype(np.float64), hits_SL.astype(np.float64)
        cpu = n - h if misses_on_cpu else np.zeros_like(n) if cpu_SL is None else cpu_SL.astype(np.float64)
        n_dev = n - cpu
        m = n_dev - h
        per_expert_tokens = tokens_S[:, None] * top_k / np.maximum(n, 1)
        c = self.compute_s(per_expert_tokens)
        other = self.num_shared * self.compute_s(tokens_S[:, None]) + self.dense_bytes_per_layer / self.device.mem_Bps
        load = self.expert_bytes / self.link.bytes_per_s + self.link.latency_s
        sigma = 0.0 if self.calibration is None else self.calibration.io_slowdown
        if self.overlap == "none":
            device = n_dev * c + m * load
        else:  # every miss is loaded, admitted or streamed through; a layer's misses are in flight together
            last_lands = load + np.maximum(m - 1, 0) * (self.expert_bytes / self.link.bytes_per_s)
            # compute running before the last load lands is slowed by sigma; the last expert's is not
            slowed = sigma * np.minimum(np.maximum(n_dev - 1, 0) * c, last_lands)
            slowed_misses = sigma * np.minimum(np.maximum(m - 1, 0) * c, last_lands - load)
            loaded = np.maximum(load + m * c + slowed_misses, last_lands + c)
            device = np.where(m > 0, np.maximum(n_dev * c + slowed, loaded), n_dev * c)
        layer = other + np.maximum(device, cpu * self.cpu_compute_s(per_expert_tokens))
        compute = layer.sum(1)
        if self.calibration is not None:
            kv = None if kv_S is None else kv_S.astype(np.float64)
            compute = compute + self.calibration.dense_s(tokens_S.astype(np.float64), kv)
        background = prefetch_SL.sum(1) * load
        compute = compute + sigma * np.minimum(compute, background)
        return compute + np.maximum(0.0, background - compute)
