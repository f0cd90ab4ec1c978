"""Measuring the constants the cost model uses on this machine, for one model's geometry (`moepager calibrate`).

What is measured, each as the median of repeated runs:
- memory copy rate: one large tensor copied on the device;
- one routed expert's compute time at 1 and at 64 tokens, cycling through enough distinct experts that the
  weights come from memory, not from the CPU's caches (as in a decode step);
- the per-expert fixed overhead: the same expert call on a 1-wide expert (dispatch and launches only);
- the model's non-expert time: a decode step and a 64-token prefill of the model built with 1-wide experts
  (attention, dense and shared MLPs, norms, router, LM head and the per-layer expert bookkeeping), less the
  1-wide experts' own overhead;
- disk: experts read from the checkpoint with the store's reader (O_DIRECT where allowed) by `io_threads`
  threads at once (the aggregate rate) and one at a time (the latency beyond that rate);
- on CUDA: host->device copies of one expert from pinned memory.
The result is a `CalibratedProfile` (planning/cost.py) written as JSON, which `simulate --profile` accepts.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moepager.experts.compute import expert_forward
from moepager.experts.weights import ExpertShape, ExpertWeights
from moepager.models.base import Architecture
from moepager.models.config import ModelConfig
from moepager.models.expert_reader import ExpertReader
from moepager.models.layers import ForwardBatch
from moepager.models.load import cast_model, checkpoint_dtype
from moepager.models.loader import Checkpoint
from moepager.models.registry import architecture_for
from moepager.planning.cost import Calibration, CalibratedProfile, Device, Link
from moepager.types import ExpertKey

Step = Callable[[str], None]
"""Progress: called with the name of each measurement as it finishes."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], object], reps: int, device: torch.device, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_rate(device: torch.device, nbytes: int = 512 << 20) -> float:
    """Bytes per second one device-to-device copy moves (each byte read once and written once)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return nbytes / _median_s(lambda: dst.copy_(src), 5, device)


def expert_times(shape: ExpertShape, device: torch.device, pool_bytes: int = 768 << 20,
                 tokens: Sequence[int] = (1, 64)) -> dict[int, float]:
    """Seconds per expert call at each token count, cycling over distinct experts worth `pool_bytes`."""
    count = max(4, min(64, pool_bytes // shape.nbytes))
    experts = [ExpertWeights(torch.randn(shape.numel, device=device).mul_(0.02).to(shape.dtype), shape)
               for _ in range(count)]
    out = {}
    for t in tokens:
        x = torch.randn(t, shape.hidden, device=device, dtype=shape.dtype)
        cycle = _cycle(experts)

        def run() -> None:
            for _ in range(count):
                expert_forward(x, next(cycle), F.silu)
        with torch.inference_mode():
            out[t] = _median_s(run, 5, device, warmup=1) / count
    return out


def _cycle(items: Sequence[ExpertWeights]) -> Iterator[ExpertWeights]:
    while True:
        yield from items


class _OneWideExperts:
    """An ExpertSource whose every expert is one SwiGLU unit wide: the model runs with its routed experts
    reduced to their fixed cost, so what remains is the model's non-expert time."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device):
        self.weights = ExpertWeights(torch.randn(3 * hidden, device=device).mul_(0.02).to(dtype),
                                     ExpertShape(hidden, 1, dtype))

    def stream(self, layer: int, experts: Sequence[int]) -> Iterator[ExpertWeights]:
        for _ in experts:
            yield self.weights


def dense_times(arch: Architecture, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                prompt: int = 64, steps: int = 24) -> tuple[float, float]:
    """(seconds per decode step, seconds of a `prompt`-token prefill) of the model with 1-wide experts."""
    model = arch.build(cfg, _OneWideExperts(cfg.hidden_size, dtype, device))  # type: ignore[arg-type]
    cast_model(model, dtype)
    model.to(device).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt + steps), generator=gen).to(device)
    with torch.inference_mode():
        def prefill() -> list:
            cache = model.make_cache(1, prompt + steps + 1, dtype, device)
            positions = torch.arange(prompt, device=device)[None]
            model(ids[:, :prompt], ForwardBatch.build(positions), cache,
                  logits_at_B=torch.tensor([prompt - 1], device=device))
            return cache
        prefill_s = _median_s(prefill, 3, device, warmup=1)
        cache, times = prefill(), []
        for i in range(steps):
            _sync(device)
            start = time.perf_counter()
            model(ids[:, prompt + i: prompt + i + 1], ForwardBatch.build(torch.tensor([[prompt + i]], device=device)),
                  cache, logits_at_B=torch.zeros(1, dtype=torch.long, device=device))
            _sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:]), prefill_s


def disk_rates(reader: ExpertReader, keys: Sequence[ExpertKey], io_threads: int) -> tuple[float, float]:
    """(aggregate bytes/s with `io_threads` reads at once, seconds per read one at a time) over `keys`,
    read into pinned-free CPU buffers as the store reads them; half the keys for each measurement."""
    shape = reader.shape
    half = max(1, len(keys) // 2)
    bufs = [torch.empty(shape.numel, dtype=shape.dtype) for _ in range(max(io_threads, 1))]
    single = []
    for i, key in enumerate(keys[:half]):
        start = time.perf_counter()
        reader.read(key, bufs[i % len(bufs)])
        single.append(time.perf_counter() - start)
    together = keys[half:] or keys[:half]
    with ThreadPoolExecutor(io_threads) as pool:
        start = time.perf_counter()
        done = sum(pool.map(lambda ik: reader.read(ik[1], bufs[ik[0] % len(bufs)]), enumerate(together)))
        wall = time.perf_counter() - start
    return done / wall, statistics.median(single)


def h2d_rate(nbytes: int, device: torch.device) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _median_s(lambda: dst.copy_(src, non_blocking=True), 10, device)


@dataclass(frozen=True)
class CalibrateOptions:
    device: str = "cpu"
    io_threads: int = 4
    """Concurrent disk reads, as the store's --io-threads."""
    disk_experts: int = 32
    """Experts read from the checkpoint (distinct, spread over layers) for the disk rates."""


def calibrate(path: str | os.PathLike[str], options: CalibrateOptions, step: Step | None = None) -> CalibratedProfile:
    """Measure this machine for the model at `path` (a checkpoint directory)."""
    step = step or (lambda _: None)
    device = torch.device(options.device)
    checkpoint = Checkpoint(path)
    arch = architecture_for(checkpoint.config)
    cfg = arch.parse_config(checkpoint.config)
    dtype = checkpoint_dtype(checkpoint)
    shape = ExpertShape(cfg.hidden_size, cfg.expert_intermediate_size, dtype)
    measured: dict[str, float] = {}
    measured["copy_Bps"] = copy_rate(device)
    step("memory copy rate")
    per_expert = expert_times(shape, device)
    measured |= {"expert_s_1": per_expert[1], "expert_s_64": per_expert[64]}
    step("expert compute, 1 and 64 tokens")
    overhead = expert_times(ExpertShape(cfg.hidden_size, 1, dtype), device, pool_bytes=0, tokens=(1,))[1]
    measured["expert_overhead_s"] = overhead
    step("per-expert fixed overhead")
    decode_s, prefill_s = dense_times(arch, cfg, dtype, device)
    experts_per_token = cfg.num_moe_layers * cfg.top_k
    measured |= {"dense_decode_raw_s": decode_s, "dense_prefill64_raw_s": prefill_s}
    step("non-expert decode step and prefill")
    reader = ExpertReader(checkpoint, arch.expert_naming, shape, cfg.moe_layers[0] if cfg.moe_layers else 0)
    stride = max(1, (cfg.num_moe_layers * cfg.num_experts) // options.disk_experts)
    keys = [ExpertKey(cfg.moe_layers[(i // cfg.num_experts) % cfg.num_moe_layers], i % cfg.num_experts)
            for i in range(0, cfg.num_moe_layers * cfg.num_experts, stride)][: options.disk_experts]
    disk_Bps, single_s = disk_rates(reader, keys, options.io_threads)
    reader.files.close()
    measured |= {"disk_Bps": disk_Bps, "disk_single_read_s": single_s}
    step("disk reads (O_DIRECT where allowed)")
    link = Link(f"disk, {options.io_threads} reads at once", disk_Bps, max(0.0, single_s - shape.nbytes / disk_Bps))
    if device.type == "cuda":
        rate = h2d_rate(shape.nbytes, device)
        measured["h2d_Bps"] = rate
        link = Link("host->device from pinned memory", rate, 0.0)
        step("host->device copies")
    params = shape.numel
    flops = 64 * 2 * params / max(per_expert[64] - overhead, 1e-9)
    name = f"calibrated {device.type} ({torch.get_num_threads()} threads) for {checkpoint.path.name}"
    dev = Device(name, shape.nbytes / max(per_expert[1] - overhead, 1e-9), flops, overhead)
    calibration = Calibration(
        expert_bytes=shape.nbytes, expert_s_1=per_expert[1], expert_s_64=per_expert[64],
        dense_decode_s=max(0.0, decode_s - experts_per_token * overhead),
        dense_token_s=max(0.0, (prefill_s - decode_s) / 63), model=str(checkpoint.path),
        threads=torch.get_num_threads(), device=device.type)
    return CalibratedProfile(name, dev, link, calibration, measured)
