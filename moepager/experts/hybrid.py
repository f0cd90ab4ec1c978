"""Hybrid execution: an expert that is not on the device is computed where it already is, in host memory on the CPU,
instead of being copied over (SMoE; llama.cpp's `--cpu-moe` and kTransformers put every routed expert there).

`--execution` (config.py EXECUTIONS):
- `gpu`: every expert computed on the device, a miss copied in first (the paged executor, experts/executor.py);
- `hybrid` (`HybridExecutor`): per MoE layer, after the router, each used expert is placed by SMoE's rule
  (Algorithm 1, `ExpertTimes.on_device`): on the device when it is there already (a hit, or loading: the layer
  waits for it), or when computing it on the CPU would take longer than copying it and computing it on the device,
  T_CPU(n) > T_dev(n) + T_copy for its n tokens; else on the CPU from the host tier, read from disk into it first
  when it is not there. A decode's misses (one token each) go to the CPU, a prefill's heavy experts to the device,
  through the store's two stream rows only (SMoE's ping-pong buffers, §2.3: one loads while the other computes;
  the decode cache is left alone), heaviest first; at the first decode pass after a prefill each layer's cache is
  filled with the experts its prefill activated most (SMoE's initial decode cache, §2.4: the top S by tokens
  routed, S the layer's slots; loaded ahead, as prefetches). `--hybrid-prefill cache` instead sends a prefill's
  heavy experts through the cache (they take its slots, the misses beyond the layer's share streaming). The CPU
  part runs on its own thread (`CpuPool`, `--cpu-threads` torch threads) while the device part computes. The
  device cache changes through the decode's experts placed on the device, the initial cache and prefetches (a
  predictor's forecasts), as SMoE's does, and with `--hybrid-admit N` through up to N of each layer's
  CPU experts copied in the background after the layer (the cache then follows the routing at a bounded cost of the
  link; `moepager simulate --execution hybrid+admitN` says what N is worth on a trace);
- `cpu-experts` (`CpuExpertsExecutor`): every routed expert on the CPU in host memory, attention and dense layers
  on the device (llama.cpp `--cpu-moe`).

Lossless: every expert's rows do not depend on which side computed them when both sides run the same kernel (a CPU
run: the device side is the CPU, with its own thread), so each token's sum in ascending expert order is the
all-resident run's bit for bit (tested). On CUDA the CPU rows come from the CPU's kernel, whose roundings differ from
the GPU's: both sides' rows are weighted in fp32 and each token sums them in ascending expert order (deterministic),
within a stated tolerance of the GPU-only run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moepager.config import HybridPrefill, Kernel
from moepager.experts.executor import ArenaKernels, Batch, ExpertExecutor, PagedExecutor
from moepager.experts.protocols import FusedKernel
from moepager.experts.sorting import SortedTokens, sort_by_expert
from moepager.experts.weights import ExpertShape
from moepager.store.host_compute import HostCompute
from moepager.store.store import ExpertStore
from moepager.store.tiers import HostHeld
from moepager.types import ExpertKey, RoutingDecision, run_on_host, to_device, to_host


@dataclass(frozen=True)
class ExpertTimes:
    """What one routed expert costs on each side, for placing it (planning/cost.py `CostModel.expert_times` builds
    it from a calibrated profile or the nominal figures): linear in its token count n."""

    cpu_s_1: float
    """Computing it on the CPU for one token, weights in host memory."""
    cpu_s_token: float
    """... each further token."""
    device_s_1: float
    device_s_token: float
    copy_s: float
    """Copying it from host memory into a device slot."""

    def cpu_s(self, tokens: int) -> float:
        return self.cpu_s_1 + (tokens - 1) * self.cpu_s_token

    def device_s(self, tokens: int) -> float:
        return self.device_s_1 + (tokens - 1) * self.device_s_token

    def on_device(self, tokens: int) -> bool:
        """SMoE's rule for an expert not on the device: copy it over when T_CPU(n) > T_dev(n) + T_copy."""
        return self.cpu_s(tokens) > self.device_s(tokens) + self.copy_s

    def threshold(self, most: int = 1 << 20) -> int | None:
        """The fewest tokens that send a missing expert to the device (None: none up to `most`): both times are
        linear, so every count from there up goes too when the CPU's slope is the steeper."""
        lo, hi = 1, most
        if not self.on_device(hi):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if self.on_device(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def describe(self) -> str:
        n = self.threshold()
        where = "every missing expert on the CPU" if n is None else \
            f"a missing expert on the device from {n} token{'s' if n > 1 else ''} up, on the CPU below"
        return (f"{where} (CPU {self.cpu_s_1 * 1e3:.2f} ms + {self.cpu_s_token * 1e3:.3f} ms/token, device "
                f"{self.device_s_1 * 1e3:.2f} ms + {self.device_s_token * 1e3:.3f} ms/token, copy "
                f"{self.copy_s * 1e3:.2f} ms)")


class CpuPool:
    """The thread that computes a layer's CPU experts while the calling thread runs the device's, with its own
    torch thread count (OpenMP's is per thread: the caller's is left as it was)."""

    def __init__(self, threads: int | None):
        self.threads = threads
        self._pool = ThreadPoolExecutor(1, "moepager-cpu-experts", initializer=self._init)

    def _init(self) -> None:
        if self.threads is not None:
            caller = torch.get_num_threads()
            torch.set_num_threads(self.threads)
            _restore_default(caller)

    def submit(self, fn: Callable[..., torch.Tensor], *args: object) -> Future[torch.Tensor]:
        """`fn(*args)` on the pool's thread, in the caller's inference and grad modes (both are per thread)."""
        return self._pool.submit(_in_modes, torch.is_inference_mode_enabled(), torch.is_grad_enabled(), fn, args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _in_modes(inference: bool, grad: bool, fn: Callable[..., torch.Tensor], args: tuple[object, ...]) -> torch.Tensor:
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        return fn(*args)


def _restore_default(threads: int) -> None:
    """`torch.set_num_threads` also sets the count that threads started later begin with: put that back (the
    calling thread's own count, and this thread's, are per thread)."""
    t = threading.Thread(target=torch.set_num_threads, args=(threads,))
    t.start()
    t.join()


def combine_fp32(y_MD: torch.Tensor, work: SortedTokens, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Weighted fp32 rows in expert order summed per token in ascending expert order, then rounded once: a stable
    sort by token keeps each token's rows in expert order, and `sum` over its K rows is deterministic (an fp32
    `index_add_` on CUDA is not)."""
    by_token = torch.argsort(work.token_M, stable=True)
    return y_MD.index_select(0, by_token).view(n, k, -1).sum(1).to(dtype)


class HybridExecutor:
    """`--execution hybrid`: a layer's experts placed per expert between the device (through the store) and the CPU
    (in the store's host tier), computed at the same time, summed in one fixed order (module note)."""

    def __init__(self, store: ExpertStore, shape: ExpertShape, kernel: Kernel, device_fused: FusedKernel | None,
                 host_fused: FusedKernel | None, times: ExpertTimes, pool: CpuPool, admit: int = 0,
                 prefill: HybridPrefill = "ping-pong"):
        if store.host is None:
            raise ValueError("hybrid execution needs a store with a host tier")
        self.paged = PagedExecutor(store, shape, kernel, device_fused)
        self.host = ArenaKernels(store.host.buffers, shape, kernel, fused=host_fused)
        self.store, self.times, self.pool = store, times, pool
        self.host_tier = HostCompute(store)
        self.admit = admit
        """Experts of a layer computed on the CPU (the lowest ids) then copied to the device in the background."""
        self.prefill = prefill
        self.activations: dict[int, dict[int, int]] = {}
        """Ping-pong prefill: tokens routed to each (layer, expert) in the prefill passes since the last decode pass
        (every expert the router chose, wherever it was computed), for the initial decode cache."""
        self.device = store.device.buffers.device
        self.shared_memory = self.device.type == "cpu"
        """The device side computes in RAM too (a CPU run): the CPU side writes its rows straight into the device
        side's (tests set it False to run the CUDA run's copies and merge on the CPU)."""
        notes = {device_fused.note if device_fused else "", host_fused.note if host_fused else ""} - {""}
        self.compute_note = "; ".join(sorted(notes)) + ("" if self.device.type == "cpu" or host_fused is None else
                                                        " (CPU experts)")

    def close(self) -> None:
        self.pool.close()

    def placement(self, layer: int, work: SortedTokens) -> tuple[list[int], list[int]]:
        """Indices into work.experts computed on the device and on the CPU."""
        device, cpu, on_device, times, starts = [], [], self.host_tier.on_device, self.times, work.starts
        for i, e in enumerate(work.experts):
            if on_device(ExpertKey(layer, e)) or times.on_device(starts[i + 1] - starts[i]):
                device.append(i)
            else:
                cpu.append(i)
        return device, cpu

    def run(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        work = sort_by_expert(x_ND, route)
        pingpong = self.prefill == "ping-pong" and self.store.counters.phase == "prefill"
        if pingpong:
            counts, starts = self.activations.setdefault(layer, {}), work.starts
            for i, e in enumerate(work.experts):
                counts[e] = counts.get(e, 0) + starts[i + 1] - starts[i]
        elif self.activations:
            self.initial_cache()
        device, cpu = self.placement(layer, work)
        if pingpong and device:  # heaviest first through the two rows, as SMoE's pipeline orders them
            device.sort(key=lambda i: (work.starts[i] - work.starts[i + 1], i))
        if not cpu:
            if not pingpong:
                return self.paged.run(layer, x_ND, route, work)
            batch = self.paged.kernels.batch(work, x_ND)
            self.paged.through_store(layer, work, device, batch, cache=False)
            return batch.combine(x_ND, work)
        same = self.shared_memory
        batch = self.paged.kernels.batch(work, x_ND)
        host_work, host_x = (work, x_ND) if same else _on_host(work, x_ND)
        host_batch = self.host.batch(host_work, host_x, batch.y_MD if same else None)
        if same and (host_batch.fused is None) != (batch.fused is None):
            raise RuntimeError("hybrid execution on the CPU: both sides must compute rows of one format")
        held = self.host_tier.acquire(layer, [work.experts[i] for i in cpu])
        try:
            future = self.pool.submit(self._cpu_part, held, host_work, cpu, host_batch)
            try:
                if device:
                    self.paged.through_store(layer, work, device, batch, cache=not pingpong)
            finally:
                future.result()  # the host slots stay pinned until the CPU is done with them
        finally:
            self.host_tier.release(held)
        if self.admit:
            self.host_tier.admit(layer, [work.experts[i] for i in cpu[: self.admit]],
                                 [work.experts[i] for i in device])
        if same:
            return batch.combine(x_ND, work)
        return self._merge(x_ND, work, cpu, batch, host_batch)

    def initial_cache(self) -> None:
        """SMoE's initial decode cache (§2.4), at the first decode pass after a prefill: each layer's slots (its
        quota) filled with the experts its prefill routed the most tokens to (ties: the lower id), most activated
        first, loaded ahead as `--hybrid-admit`'s copies are (evicting by the policy outside them); the counts start
        again."""
        quota = self.store.device.table.quota
        for layer, counts in self.activations.items():
            top = sorted(counts, key=lambda e: (-counts[e], e))[: quota.get(layer, 0)]
            self.host_tier.admit(layer, top, top)
        self.activations = {}

    def _cpu_part(self, held: HostHeld, work: SortedTokens, cpu: Sequence[int], batch: Batch) -> torch.Tensor:
        """On the pool's thread: the CPU experts once their host slots hold them."""
        for read in held.reads:
            if read is not None:
                read.result()  # re-raises a failed read
        rows = [-1] * len(work.experts)
        for i, slot in zip(cpu, held.slots):
            rows[i] = slot
        batch.some(work, rows, cpu, batch.y_MD)
        return batch.y_MD

    def _merge(self, x_ND: torch.Tensor, work: SortedTokens, cpu: Sequence[int], batch: Batch,
               host_batch: Batch) -> torch.Tensor:
        """CUDA: the CPU's rows into the device's, then one sum per token in ascending expert order."""
        index_host = work.rows_of(cpu)
        index_M = to_device(index_host, self.device)
        host_rows = to_device(host_batch.y_MD.index_select(0, index_host), self.device)
        n, k = x_ND.shape[0], work.x_MD.shape[0] // max(x_ND.shape[0], 1)
        if batch.fused is None and host_batch.fused is None:  # both unweighted in x's dtype: the usual combine
            batch.y_MD[index_M] = host_rows
            return batch.combine(x_ND, work)
        y_MD = batch.y_MD.float()
        if batch.fused is None:
            y_MD = y_MD * work.w_M1.float()
        if host_batch.fused is None:
            host_rows = host_rows.float() * work.w_M1.index_select(0, index_M).float()
        y_MD[index_M] = host_rows
        return combine_fp32(y_MD, work, n, k, x_ND.dtype)

    def stream(self, layer: int, experts: Sequence[int]):  # noqa: ANN201 - the reference's ExpertSource seam
        return self.paged.stream(layer, experts)


def _on_host(work: SortedTokens, x_ND: torch.Tensor) -> tuple[SortedTokens, torch.Tensor]:
    """The sorted tokens and x copied to the host at once (one wait for the device)."""
    x_ND, w_M1, token_M = to_host(x_ND, work.w_M1, work.token_M)
    x_MD = x_ND.expand(work.x_MD.shape[0], -1) if work.x_1D is not None else x_ND.index_select(0, token_M)
    return SortedTokens(x_MD, w_M1, token_M, work.experts, work.starts, x_ND if work.x_1D is not None else None), x_ND


class CpuExpertsExecutor:
    """`--execution cpu-experts`: every routed expert computed on the CPU by `inner` (an executor over host memory:
    all resident, or paged from disk), on the pool's thread; the layer's input copied over and its output back."""

    def __init__(self, inner: ExpertExecutor, device: torch.device, pool: CpuPool):
        self.inner, self.device, self.pool = inner, device, pool
        self.compute_note = inner.compute_note + (" (CPU experts)" if inner.compute_note and device.type != "cpu"
                                                  else "")
        self.store: ExpertStore | None = getattr(inner, "store", None)

    def close(self) -> None:
        self.pool.close()

    def run(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        return run_on_host(lambda x, r: self.pool.submit(self.inner.run, layer, x, r).result(), x_ND, route)

    def stream(self, layer: int, experts: Sequence[int]):  # noqa: ANN201 - the reference's ExpertSource seam
        return self.inner.stream(layer, experts)  # type: ignore[attr-defined]
