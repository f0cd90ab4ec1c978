"""Measuring the constants the cost model uses on this machine, for one model's geometry (`moepager calibrate`).

What is measured, each as the median of repeated runs:
- memory copy rate: one large tensor copied on the device;
- one routed expert's compute time at 1 token as a decode step pays it: the model's decode step with full-size
  experts (distinct ones, from memory) less the same step with 1-wide experts, per expert; and at 64 tokens,
  cycling through enough distinct experts that the weights come from memory;
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

import itertools
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moepager.accel import cpu_kernels
from moepager.accel.packed import pack_dense
from moepager.accel.step import step_backend
from moepager.checkpoints.dtypes import checkpoint_dtype
from moepager.checkpoints.expert_reader import ExpertReader
from moepager.checkpoints.safetensors import Checkpoint
from moepager.experts.executor import ArenaKernels, combine
from moepager.experts.quant import QuantExpertWeights, quantize_expert
from moepager.experts.reference import expert_forward
from moepager.experts.sorting import sort_by_expert
from moepager.experts.weights import ExpertShape, expert_view
from moepager.loading.build import cast_model, open_experts
from moepager.models.attention import ForwardBatch
from moepager.models.base import Architecture
from moepager.models.config import ModelConfig
from moepager.models.registry import architecture_for
from moepager.planning.cost import CalibratedProfile, Calibration, Device, Link
from moepager.types import ExpertKey, RoutingDecision

Step = Callable[[str], None]
"""Progress: called with the name of each measurement as it finishes."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def copy_rate(device: torch.device, nbytes: int = 512 << 20) -> float:
    """Bytes per second one device-to-device copy moves (each byte read once and written once)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return nbytes / statistics.median([_timed(lambda: dst.copy_(src), device) for _ in range(6)][1:])


def random_arena(rows: int, shape: ExpertShape, device: torch.device) -> torch.Tensor:
    """`rows` experts of `shape` with random weights (timing stand-ins): float ones drawn per row, quantized ones
    one random float expert quantized in `shape`'s format and copied to every row (distinct memory, same values)."""
    if shape.quant is None:
        return torch.randn(rows, shape.numel, device=device).mul_(0.02).to(shape.dtype)
    one = torch.empty(shape.numel, dtype=shape.buffer_dtype)
    d, f = shape.hidden, shape.intermediate
    view = expert_view(one, shape)
    assert isinstance(view, QuantExpertWeights)
    quantize_expert(torch.randn(2 * f, d).mul_(0.02), torch.randn(d, f).mul_(0.02), view, shape.dtype)
    return one.to(device).expand(rows, -1).clone()


FUSED_GROUP = 8
"""Experts per fused layer call when timing the fused kernel (a top-8 layer's worth)."""

class ExpertPool:
    """Distinct experts worth `pool_bytes`, called in turn so that each call's weights come from memory."""

    def __init__(self, shape: ExpertShape, device: torch.device, pool_bytes: int = 768 << 20):
        self.count = max(FUSED_GROUP, min(64, pool_bytes // shape.nbytes))
        self.shape, self.device = shape, device
        self.arena = random_arena(self.count, shape, device)
        self.experts = [expert_view(row, shape) for row in self.arena]
        self.fused = cpu_kernels.fused_experts(shape, device, "auto")
        """The kernel a run computes these experts with on the CPU where it applies (accel/cpu_kernels.py)."""

    def seconds_per_call(self, tokens: int) -> float:
        """Mean seconds of one expert call on `tokens` tokens over one pass through the pool (with the fused kernel:
        FUSED_GROUP experts a layer call, as a layer computes them, and its time shared among them)."""
        x = torch.randn(tokens, self.shape.hidden, device=self.device, dtype=self.shape.dtype)
        fused = self.fused if self.fused is not None and tokens <= self.fused.max_tokens else None
        if fused is not None:
            groups = self.count // FUSED_GROUP
            ids = [torch.arange(g * FUSED_GROUP, (g + 1) * FUSED_GROUP).expand(tokens, -1) for g in range(groups)]
            w = torch.full((tokens, FUSED_GROUP), 1 / FUSED_GROUP, dtype=self.shape.dtype)

            def run() -> None:
                for ids_NK in ids:
                    fused.resident(x, ids_NK, w, self.arena, 0, self.count)
            with torch.inference_mode():
                run()
                return _timed(run, self.device) / (groups * FUSED_GROUP)

        def run() -> None:
            for w in self.experts:
                expert_forward(x, w, F.silu)
        with torch.inference_mode():
            expert_forward(x, self.experts[0], F.silu)
            return _timed(run, self.device) / self.count


class _ArenaStandIn:
    """An executor over a small arena whose rows stand in for every expert (`rows` picks them per call)."""

    def __init__(self, shape: ExpertShape, count: int, device: torch.device):
        self.kernels = ArenaKernels(random_arena(count, shape, device), shape,
                                    fused=cpu_kernels.fused_experts(shape, device, "auto"))
        self.count, self._next = count, 0

    def rows(self, n: int) -> list[int]:
        return [0] * n

    def run(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        work = sort_by_expert(x_ND, route)
        rows, fused = self.rows(len(work.experts)), self.kernels.fused
        if fused is not None and x_ND.shape[0] <= fused.max_tokens:  # as a run computes them (the fused kernel)
            return self.kernels.fused_compute(fused, work, rows, x_ND)
        return combine(x_ND, work, self.kernels.compute(work, rows))


class _OneWideExperts(_ArenaStandIn):
    """Every expert one SwiGLU unit wide: the model runs with its routed experts reduced to their fixed cost,
    so what remains is the model's non-expert time."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device):
        super().__init__(ExpertShape(hidden, 1, dtype), 1, device)


class _CyclingExperts(_ArenaStandIn):
    """`count` distinct full-size experts handed out in turn: one decode step of the model reads as many
    different expert weights as a real one, from memory, between its real dense layers."""

    def __init__(self, shape: ExpertShape, count: int, device: torch.device):
        super().__init__(shape, count, device)

    def rows(self, n: int) -> list[int]:
        out = [(self._next + i) % self.count for i in range(n)]
        self._next = (self._next + n) % self.count
        return out


class DenseProbe:
    """The model built with 1-wide experts (random weights): times its prefills and decode steps."""

    def __init__(self, arch: Architecture, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 longest: int, steps: int = 8):
        self.model = arch.build(cfg, _OneWideExperts(cfg.hidden_size, dtype, device), step_backend(dtype, device))
        cast_model(self.model, dtype)
        self.model.to(device).eval()
        if device.type == "cpu":  # the dense projections' kernel and the step's norms and routers, as a run's
            pack_dense(self.model)  # (accel/packed.py, accel/step.py; its contiguous cache: torch's attention)
            self.model.backend.fuse(self.model)
        self.dtype, self.device, self.steps = dtype, device, steps
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, cfg.vocab_size, (1, longest + steps), generator=gen).to(device)

    def use_experts(self, executor: _ArenaStandIn) -> None:
        """Compute every MoE block's experts with `executor` (1-wide or full-size)."""
        for block in self.model.moe_blocks():
            block.executor = executor

    def prefill_then_decode(self, prompt: int) -> tuple[float, list[float]]:
        """Seconds of a `prompt`-token prefill, then of each of `steps` decode steps after it."""
        cache = self.model.make_cache(1, prompt + self.steps + 1, self.dtype, self.device)
        positions = torch.arange(prompt, device=self.device)[None]
        last = torch.tensor([prompt - 1], device=self.device)
        with torch.inference_mode():
            prefill = _timed(lambda: self.model(self.ids[:, :prompt], ForwardBatch.build(positions), cache,
                                                logits_at_B=last), self.device)
            zero = torch.zeros(1, dtype=torch.long, device=self.device)
            steps = [_timed(lambda i=i: self.model(self.ids[:, i: i + 1],
                                                   ForwardBatch.build(torch.tensor([[i]], device=self.device)),
                                                   cache, logits_at_B=zero), self.device)
                     for i in range(prompt, prompt + self.steps)]
        return prefill, steps


def parallel_rate(reader: ExpertReader, keys: Sequence[ExpertKey], io_threads: int, seconds: float = math.inf
                  ) -> float:
    """Bytes/s reading `keys` into CPU buffers as the store reads them, `io_threads` at once as a layer's misses are;
    no read started after `seconds` but each thread's first, so a slow disk costs about one read's time beyond them."""
    order, threads = itertools.count(), max(1, min(io_threads, len(keys)))
    start = time.perf_counter()

    def reading(_: int) -> int:
        buf, done = torch.empty(reader.shape.numel, dtype=reader.shape.buffer_dtype), 0
        while (i := next(order)) < len(keys) and (i < threads or time.perf_counter() - start < seconds):
            done += reader.read(keys[i], buf)
        return done

    with ThreadPoolExecutor(threads) as pool:
        nbytes = sum(pool.map(reading, range(threads)))
    return nbytes / max(time.perf_counter() - start, 1e-9)


def disk_rates(reader: ExpertReader, keys: Sequence[ExpertKey], io_threads: int) -> tuple[float, float]:
    """(aggregate bytes/s with `io_threads` reads at once, seconds per read one at a time) over `keys` (random
    experts, as cache misses are: reading neighbours in file order would flatter the disk), read into CPU
    buffers as the store reads them; half the keys for each measurement."""
    half = max(1, len(keys) // 2)
    buf = torch.empty(reader.shape.numel, dtype=reader.shape.buffer_dtype)
    single = []
    for key in keys[:half]:
        start = time.perf_counter()
        reader.read(key, buf)
        single.append(time.perf_counter() - start)
    return parallel_rate(reader, keys[half:] or keys[:half], io_threads), statistics.median(single)


def io_slowdown(pool: ExpertPool, reader: ExpertReader, keys: Sequence[ExpertKey], io_threads: int) -> float:
    """How much slower expert compute runs while disk reads run beside it, as a fraction (on a small CPU the
    reading threads' copies, syscalls and DMA share cores and memory bandwidth with the expert GEMVs)."""
    alone = statistics.median(pool.seconds_per_call(1) for _ in range(3))
    stop = threading.Event()

    def reading(t: int) -> None:
        buf, i = torch.empty(reader.shape.numel, dtype=reader.shape.buffer_dtype), t
        while not stop.is_set():
            reader.read(keys[i % len(keys)], buf)
            i += io_threads
    threads = [threading.Thread(target=reading, args=(t,), daemon=True) for t in range(io_threads)]
    for t in threads:
        t.start()
    busy = statistics.median(pool.seconds_per_call(1) for _ in range(3))
    stop.set()
    for t in threads:
        t.join()
    return max(0.0, busy / alone - 1)


def h2d_rate(nbytes: int, device: torch.device) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / statistics.median([_timed(lambda: dst.copy_(src, non_blocking=True), device)
                                       for _ in range(11)][1:])


@dataclass(frozen=True)
class CalibrateOptions:
    device: str = "cpu"
    io_threads: int = 4
    """Concurrent disk reads, as the store's --io-threads."""
    disk_experts: int = 48
    """Experts read from the checkpoint (distinct, spread over layers) for the disk rates."""
    rounds: int = 7
    """Interleaved rounds of the compute measurements (their medians are kept)."""
    prefill_tokens: int = 64
    """Prompt length of the non-expert prefill measured (measure at the length a run will use: attention
    grows faster than linearly with it)."""


SHORT_PROMPT = 16
"""Prompt before the short-context decode steps (their KV length is about SHORT_PROMPT + steps / 2)."""


def compute_times(arch: Architecture, cfg: ModelConfig, shape: ExpertShape, device: torch.device,
                  rounds: int, prefill_tokens: int) -> dict[str, float]:
    """Medians over interleaved rounds (drift on a shared machine touches every constant alike): one expert
    at 1 and 64 tokens, the 1-wide expert's overhead, and the model's non-expert time: decode steps after a
    short and after a `prefill_tokens` prompt (attention reads the whole KV cache), and that prefill."""
    pool, wide = ExpertPool(shape, device), ExpertPool(ExpertShape(cfg.hidden_size, 1, shape.dtype), device, 0)
    long = max(prefill_tokens, SHORT_PROMPT + 1)
    dense = DenseProbe(arch, cfg, shape.dtype, device, long)
    one_wide = dense.model.moe_blocks()[0].executor
    full = _CyclingExperts(shape, cfg.num_moe_layers * cfg.top_k, device)
    dense.prefill_then_decode(long)  # warm-up
    samples: dict[str, list[float]] = {k: [] for k in ("expert_s_64", "expert_overhead_s", "dense_decode_raw_s",
                                                       "dense_decode_long_raw_s", "dense_prefill_raw_s",
                                                       "decode_full_raw_s")}
    for _ in range(rounds):
        samples["expert_s_64"].append(pool.seconds_per_call(64))
        samples["expert_overhead_s"].append(wide.seconds_per_call(1))
        samples["dense_decode_raw_s"] += dense.prefill_then_decode(SHORT_PROMPT)[1]
        dense.use_experts(full)
        samples["decode_full_raw_s"] += dense.prefill_then_decode(SHORT_PROMPT)[1]
        dense.use_experts(one_wide)
        prefill, steps = dense.prefill_then_decode(long)
        samples["dense_prefill_raw_s"].append(prefill)
        samples["dense_decode_long_raw_s"] += steps
    out = {k: statistics.median(v) for k, v in samples.items()}
    # one expert at 1 token as a decode step pays for it: the full-size step less the 1-wide one, per expert,
    # plus the call overhead the 1-wide step already paid (an isolated loop over experts overstates it ~2x)
    per_token = cfg.num_moe_layers * cfg.top_k
    # an expert costs at least its call's fixed overhead: for experts so small that their weights add less than
    # the two steps' timing noise, the difference alone can come out below it (even negative)
    out["expert_s_1"] = max(out["decode_full_raw_s"] - out["dense_decode_raw_s"], 0.0) / per_token \
        + out["expert_overhead_s"]
    middle = (dense.steps + 1) / 2
    return out | {"dense_decode_kv": SHORT_PROMPT + middle, "dense_long_kv": long + middle}


@dataclass(frozen=True)
class ModelParts:
    """What calibration reads of a checkpoint: its architecture, geometry, expert shape and expert reader."""

    checkpoint: Checkpoint
    arch: Architecture
    cfg: ModelConfig
    shape: ExpertShape
    reader: ExpertReader

    @classmethod
    def open(cls, path: str | os.PathLike[str], device: torch.device = torch.device("cpu")) -> ModelParts:
        """A quantized checkpoint (`moepager quantize`) is measured in its own format, as a run pages it."""
        checkpoint = Checkpoint(path)
        arch = architecture_for(checkpoint.config)
        cfg = arch.parse_config(checkpoint.config)
        reader = open_experts(checkpoint, arch, cfg, checkpoint_dtype(checkpoint), device)
        return cls(checkpoint, arch, cfg, reader.shape, reader)

    def expert_keys(self) -> list[ExpertKey]:
        return [ExpertKey(layer, e) for layer in self.cfg.moe_layers for e in range(self.cfg.num_experts)]


class DiskSampler:
    """Samples the disk rates again and again over a long run (a shared machine's disk drifts, by 2x within minutes),
    each time on random experts not read before, as `calibrate` measures them."""

    def __init__(self, path: str | os.PathLike[str], io_threads: int, seed: int = 1):
        parts = ModelParts.open(path)
        self.reader, self.keys = parts.reader, parts.expert_keys()
        self.io_threads, self.gen = io_threads, torch.Generator().manual_seed(seed)
        self.samples: list[tuple[float, float]] = []

    def sample(self, count: int = 48) -> tuple[float, float]:
        """(aggregate bytes/s, seconds per single read) over `count` random experts; kept in `samples`."""
        order = torch.randperm(len(self.keys), generator=self.gen)[:count].tolist()
        self.samples.append(disk_rates(self.reader, [self.keys[i] for i in order], self.io_threads))
        return self.samples[-1]

    def link(self, nbytes: int) -> Link:
        """The disk link at the samples' mean rate and single-read time."""
        rate = statistics.fmean(s[0] for s in self.samples)
        single = statistics.fmean(s[1] for s in self.samples)
        return Link(f"disk, {self.io_threads} reads at once, mean of {len(self.samples)} samples", rate,
                    max(0.0, single - nbytes / rate))

    def close(self) -> None:
        self.reader.files.close()


def calibrate(path: str | os.PathLike[str], options: CalibrateOptions, step: Step | None = None) -> CalibratedProfile:
    """Measure this machine for the model at `path` (a checkpoint directory)."""
    step = step or (lambda _: None)
    device = torch.device(options.device)
    parts = ModelParts.open(path, device)
    checkpoint, arch, cfg, shape, reader = parts.checkpoint, parts.arch, parts.cfg, parts.shape, parts.reader
    measured = {"copy_Bps": copy_rate(device)}
    step("memory copy rate")
    measured |= compute_times(arch, cfg, shape, device, options.rounds, options.prefill_tokens)
    step(f"expert and non-expert compute, {options.rounds} rounds")
    every = parts.expert_keys()
    keys = [every[i] for i in torch.randperm(len(every), generator=torch.Generator().manual_seed(0)).tolist()]
    disk_Bps, single_s = disk_rates(reader, keys[: options.disk_experts], options.io_threads)
    measured |= {"disk_Bps": disk_Bps, "disk_single_read_s": single_s}
    step("disk reads (O_DIRECT where allowed)")
    measured["io_slowdown"] = 0.0 if device.type == "cuda" else io_slowdown(
        ExpertPool(shape, device), reader, keys[options.disk_experts:] or keys, options.io_threads)
    reader.files.close()
    step("compute slowed by reads running beside it")
    link = Link(f"disk, {options.io_threads} reads at once", disk_Bps, max(0.0, single_s - shape.nbytes / disk_Bps))
    cpu: dict[str, float] = {}
    if device.type == "cuda":
        measured["h2d_Bps"] = h2d_rate(shape.nbytes, device)
        link = Link("host->device from pinned memory", measured["h2d_Bps"], 0.0)
        step("host->device copies")
        host = ExpertPool(shape, torch.device("cpu"))  # hybrid execution's other side, with the run's CPU kernel
        cpu = {"cpu_expert_s_1": statistics.median(host.seconds_per_call(1) for _ in range(options.rounds)),
               "cpu_expert_s_64": statistics.median(host.seconds_per_call(64) for _ in range(options.rounds))}
        measured |= cpu
        step("experts on the CPU (hybrid execution)")
    overhead, c1, c64 = measured["expert_overhead_s"], measured["expert_s_1"], measured["expert_s_64"]
    name = f"calibrated {device.type} ({torch.get_num_threads()} threads) for {checkpoint.path.name}"
    dev = Device(name, shape.nbytes / max(c1 - overhead, 1e-9), 64 * 2 * shape.numel / max(c64 - overhead, 1e-9),
                 overhead)
    experts_per_token = cfg.num_moe_layers * cfg.top_k
    decode_s, prefill_s = measured["dense_decode_raw_s"], measured["dense_prefill_raw_s"]
    kv0, kv1 = measured["dense_decode_kv"], measured["dense_long_kv"]
    calibration = Calibration(
        expert_bytes=shape.nbytes, expert_s_1=c1, expert_s_64=c64,
        dense_decode_s=max(0.0, decode_s - experts_per_token * overhead), dense_decode_kv=kv0,
        dense_kv_s=max(0.0, (measured["dense_decode_long_raw_s"] - decode_s) / (kv1 - kv0)),
        dense_token_s=max(0.0, (prefill_s - decode_s) / (max(options.prefill_tokens, SHORT_PROMPT + 1) - 1)),
        io_slowdown=measured["io_slowdown"], model=str(checkpoint.path),
        threads=torch.get_num_threads(), device=device.type, **cpu)
    return CalibratedProfile(name, dev, link, calibration, measured)
