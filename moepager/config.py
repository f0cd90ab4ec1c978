"""Frozen, validated configuration of an engine run, and the choice lists it validates against.

A leaf: this module imports only `types` and `errors`, so every layer can take its configuration whole. What needs
an implementation to check (a policy or predictor name against its registry, int8-a8's FBGEMM, a budget against a
model's experts) is checked where the engine is built (runtime/builder.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from moepager.errors import BudgetError, ConfigError, MoepagerError
from moepager.types import Scope

Kernel = Literal["auto", "loop", "gather", "grouped", "packed", "fused"]
KERNELS: tuple[Kernel, ...] = ("auto", "loop", "gather", "grouped", "packed", "fused")
"""`--expert-kernel` choices (experts/executor.py says what each computes)."""
WorkerLoss = Literal["stop", "failover"]
"""`--on-worker-loss` choices (experts/remote/executor.py)."""
WorkerAssign = Literal["one-to-one", "fixed"]
WORKER_ASSIGNS: tuple[WorkerAssign, ...] = ("one-to-one", "fixed")
"""`--worker-assign` choices: how a layer call's experts go to its group's workers (experts/remote/placement.py)."""
WorkerPrefill = Literal["spread", "group"]
WORKER_PREFILLS: tuple[WorkerPrefill, ...] = ("spread", "group")
"""`--worker-prefill` choices: which workers compute a prompt's layer calls (experts/remote/placement.py)."""
Execution = Literal["gpu", "hybrid", "cpu-experts", "auto"]
HybridPrefill = Literal["ping-pong", "cache"]
HYBRID_PREFILLS: tuple[HybridPrefill, ...] = ("ping-pong", "cache")
EXECUTIONS: tuple[Execution, ...] = ("gpu", "hybrid", "cpu-experts", "auto")
"""`--execution` choices: where a routed expert is computed (experts/hybrid.py says what each does)."""
EXPERT_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32", "int8", "int4")
"""`--expert-dtype` choices: float formats, and the lossy opt-in int8/int4 (experts/quant.py)."""
INT4_GROUPS = (32, 64, 128)
"""`--int4-group` choices: input elements per int4 scale the kernels support."""
DENSE_FORMATS = {"int8": "int8", "int8-a8": "int8 (activations quantized to 8 bits)"}
"""`--dense-dtype` choices and how a run reports each (accel/dense_quant.py)."""
DENSE_DTYPES = tuple(DENSE_FORMATS)
MAX_COUNT = 2**40
"""The largest count an option takes (tokens, threads, steps): beyond, nothing this machine holds is that big, and
Python's integers would reach torch and C as overflows."""
MAX_WORKER_TIMEOUT_S = 86400.0
"""The longest --worker-timeout (a day; gloo's timeouts are integral milliseconds, and beyond they overflow)."""
DirectIO = Literal["auto", "on", "off"]
"""O_DIRECT disk reads (checkpoints/disk.py): where the file system allows, required, or never."""

UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30,
         "t": 2**40, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
"""Budget units: KiB/MiB/GiB/TiB and the bare K/M/G/T are powers of 1024; KB/MB/GB/TB powers of 1000."""
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z%]*)\s*$")


@dataclass(frozen=True)
class Budget:
    """A parsed memory budget ("6GiB", "1.5G", "800MB", "25%" of all routed experts, "all"): either a byte count
    or a fraction of all experts (exactly one is set)."""

    nbytes: int | None = None
    fraction: float | None = None
    text: str = ""

    @classmethod
    def parse(cls, text: str, flag: str = "budget") -> Budget:
        if text.strip().lower() == "all":
            return cls(fraction=1.0, text=text)
        if text.strip().startswith("-"):
            raise BudgetError(f"{flag} '{text}' is negative: give a positive size, e.g. 6GiB, 800MB, 25% or all")
        m = _BUDGET.match(text.lower())
        if m is None or (m.group(2) not in UNITS and m.group(2) != "%"):
            raise BudgetError(f"{flag} '{text}' is not a size: use e.g. 6GiB, 800MB, 25% or all")
        value, unit = float(m.group(1)), m.group(2)
        if unit == "%":
            if not 0 < value <= 100:
                raise BudgetError(f"{flag} '{text}' must be a percentage in (0, 100]")
            return cls(fraction=value / 100, text=text)
        return cls(nbytes=int(value * UNITS[unit]), text=text)

    def slots(self, expert_nbytes: int, total_experts: int, reserved_bytes: int = 0) -> int:
        """How many whole experts fit beside `reserved_bytes` of buffers, capped at all experts. A share (25%)
        is that share of all experts' bytes; `all` is every expert whatever the buffers."""
        if self.fraction == 1.0:
            return total_experts
        nbytes = self.nbytes if self.nbytes is not None else int(self.fraction * total_experts * expert_nbytes + 0.5)
        return max(0, min((nbytes - reserved_bytes) // expert_nbytes, total_experts))


ALL = Budget(fraction=1.0, text="all")


def check_expert_options(expert_dtype: str | None, group: int | None, zero_point: bool | None) -> None:
    """Refuse an unknown `--expert-dtype`, and int4 options without int4 or with a group the kernels lack."""
    if expert_dtype is not None and expert_dtype not in EXPERT_DTYPES:
        raise ConfigError(f"unknown --expert-dtype '{expert_dtype}'; choose from {', '.join(EXPERT_DTYPES)}")
    if expert_dtype != "int4" and (group is not None or zero_point):
        raise ConfigError("--int4-group and --int4-zero-points need --expert-dtype int4")
    if group is not None and group not in INT4_GROUPS:
        raise ConfigError(f"--int4-group must be one of {', '.join(map(str, INT4_GROUPS))}, not {group}")


def check_dense_name(dense_dtype: str | None) -> None:
    """Refuse an unknown `--dense-dtype` (whether int8-a8's FBGEMM is here is checked at load)."""
    if dense_dtype is not None and dense_dtype not in DENSE_DTYPES:
        raise ConfigError(f"unknown --dense-dtype '{dense_dtype}'; choose from {', '.join(DENSE_DTYPES)} (without "
                          "it the dense part computes in --dtype)")


@dataclass(frozen=True)
class StoreConfig:
    """Where routed experts live during a run (the expert store); the defaults keep every expert resident."""

    expert_memory: str | None = None
    """Device expert cache: a size (6GiB, 800MB), a share of all experts (25%) or all. None: all resident."""
    host_memory: str | None = None
    """CUDA runs: pinned host RAM for experts, the rest read from disk. None: every expert in host RAM."""
    policy: str = "lrfu"
    """Eviction policy (one of moepager.policies.ENGINE_POLICIES; checked when the engine is built). LRFU by
    default: on every real routing trace here it hits at least as often as LRU at every cache size, and more wherever
    the cache can choose (benchmarks/README.md, hit_rate)."""
    scope: Scope = "layer"
    """layer: each MoE layer gets an equal share of the slots; global: all layers share all slots."""
    io_threads: int = 4
    """Threads reading experts from disk."""
    prefetch_threads: int = 1
    """Threads reading prefetched experts (the transfer engine's prefetch lane; used with a predictor). More read
    ahead sooner, and spend more of the link on wrong forecasts: see README, "a wider prefetch lane"."""
    prefetch_policy: str = "expertflow"
    """What becomes of prefetched experts (policies/prefetch.py PREFETCH_POLICIES; checked when the engine is built):
    expertflow corrects them when their layer routes (ExpertFlow's real-time correction); plain lets them be."""
    prefetch_yields: bool = True
    """A prefetch gives way to demand loads between the chunks of its read too, not only before it starts, and its
    layer's routing promotes or abandons it while it runs (store/transfer.py). Off: once started, it runs to the
    end beside them."""
    direct_io: DirectIO = "auto"
    """O_DIRECT disk reads: auto (where the file system allows), on (required) or off (page cache, dropped)."""
    warm: bool = True
    """Fill the cache with experts at load time instead of starting empty."""
    layer_plan: str | None = None
    """A `moepager plan --json` file: the device cache split between MoE layers in proportion to its per-layer budgets
    (MoEpic's configurator) instead of evenly (scope layer)."""

    configure: Literal["off", "auto"] = "off"
    """auto: MoEpic's configurator online (runtime/configure.py): every `configure_every` decode tokens each layer's
    cache size (and, on a split checkpoint, split ratio) is chosen again from the routing of the recent tokens."""
    configure_every: int = 5000
    """Decode tokens between reconfigurations (MoEpic's τ)."""

    device_budget: Budget = field(init=False, repr=False, compare=False)
    """`expert_memory` parsed once (all experts when unset)."""
    host_budget: Budget = field(init=False, repr=False, compare=False)
    """`host_memory` parsed once (all experts when unset)."""

    def __post_init__(self) -> None:
        for name, flag, text in (("device_budget", "--expert-memory", self.expert_memory),
                                 ("host_budget", "--host-memory", self.host_memory)):
            object.__setattr__(self, name, ALL if text is None else Budget.parse(text, flag))
        if self.scope not in ("layer", "global"):
            raise MoepagerError(f"cache scope must be layer or global, got '{self.scope}'")
        if self.direct_io not in ("auto", "on", "off"):
            raise MoepagerError(f"direct I/O must be auto, on or off, got '{self.direct_io}'")
        if self.layer_plan is not None and (self.expert_memory is None or self.scope != "layer"):
            raise MoepagerError("--layer-plan splits the --expert-memory cache between layers: set --expert-memory "
                                "(and keep --cache-scope layer)")
        if self.configure not in ("off", "auto"):
            raise MoepagerError(f"--configure must be off or auto, got '{self.configure}'")
        if self.configure == "auto" and (self.expert_memory is None or self.scope != "layer"):
            raise MoepagerError("--configure auto sizes each layer's share of the --expert-memory cache: set "
                                "--expert-memory (and keep --cache-scope layer)")
        for flag, value in (("--io-threads", self.io_threads), ("--prefetch-threads", self.prefetch_threads),
                            ("--configure-every", self.configure_every)):
            if not isinstance(value, int) or value < 1:
                raise MoepagerError(f"{flag} must be >= 1, got {value}")
            if value > MAX_COUNT:
                raise MoepagerError(f"{flag} must be at most {MAX_COUNT}, got {value}")

    @property
    def paged(self) -> bool:
        """Whether experts go through the store (a device budget, or a host budget on CUDA)."""
        return self.expert_memory is not None or self.host_memory is not None


@dataclass(frozen=True)
class PrefetchConfig:
    """Routing prediction and prefetch (off unless a predictor is named; needs a paged store)."""

    predictor: str | None = None
    """One of moepager.predictors.PREDICTORS (checked when the engine is built); None: no prefetch."""
    file: str | None = None
    """The fitted predictor (`moepager predictor fit`); expert-map without one starts empty and learns online."""
    distance: int | None = None
    """MoE layers between a forecast and its target; None: the predictor's own (DEFAULT_DISTANCE)."""
    per_row: int | None = None
    """Experts prefetched per forecast row (fMoE's similarity rule may add more); None: the predictor's default (its
    spec's `default_per_row`, else the model's top-k); 0: prefetch nothing, the forecasts only rank evictions (fmoe,
    plec, plec-lrfu)."""
    max_inflight: int | None = None
    """Prefetches loading at once; None: twice the model's top-k."""
    min_p: float | None = None
    """Prefetch a selected expert only when its forecast probability is at least this (0: every selected one); None:
    the predictor's default (its spec's `default_min_p`). The head's probabilities are per-expert sigmoids, so 0.5
    keeps the experts it finds more likely than not."""
    learn: bool = False
    """expert-map: add every finished iteration's map to the store (fMoE's online mode)."""
    fixed: bool = False
    """SMoE's Fixed-N (§2.7): each forecast row loads exactly `per_row` experts not yet cached at its target, walking
    down its ranking past the cached ones (a steady link load). Off: its top `per_row`, loading those not cached (0
    to `per_row` loads: SMoE's Adaptive-N)."""
    flex: bool = False
    """SMoE-Flex (§2.8): after the first FLEX_PASSES forward passes, prefetch is turned off on the half of the MoE
    layers whose forecasts were least accurate (their link time goes to the others; the paper gives those 3)."""

    def __post_init__(self) -> None:
        for flag, value in (("--prefetch-distance", self.distance), ("--prefetch-inflight", self.max_inflight)):
            if value is not None and value < 1:
                raise MoepagerError(f"{flag} must be >= 1, got {value}")
        if self.per_row is not None and self.per_row < 0:
            raise MoepagerError(f"--prefetch-k must be >= 0 (0: forecasts only rank evictions), got {self.per_row}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise MoepagerError(f"--prefetch-min-p must be between 0 and 1, got {self.min_p}")


BatchPolicy = Literal["fifo", "expertflow"]
BATCH_POLICIES: tuple[BatchPolicy, ...] = ("fifo", "expertflow")
"""`--batch-policy` choices (runtime/scheduler.py says what each does)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching: how many requests run together and how much KV cache they share."""

    max_num_seqs: int = 16
    """Most requests in one step (the rest wait)."""
    max_batched_tokens: int = 512
    """Most tokens one step computes (decodes first, then prompt chunks fill the rest)."""
    kv_cache_tokens: int = 16384
    """Positions the KV cache holds over all running requests; when it runs out the youngest request is
    preempted and recomputed later. A request that needs more than this alone grows it while nothing runs."""
    block_size: int = 16
    """Positions per KV cache block."""
    batch_policy: BatchPolicy = "fifo"
    """Which running requests decode together: fifo (all of them, every step) or expertflow (twice --max-num-seqs
    requests run, as two groups of similar routing paths that decode in turns: ExpertFlow's token scheduler)."""
    batch_invariant: bool = False
    """Each request's tokens are computed in a forward pass of its own, and its prompt in chunks of a fixed size
    whatever else runs: a request's tokens never depend on which others share its steps (a batched pass computes a
    row with other kernels than a lone one: different roundings, so once in a while another greedy token), unless
    the KV cache runs out and it is recomputed. Costs the throughput batching brings (opt-in: `--deterministic`)."""

    def __post_init__(self) -> None:
        if self.batch_policy not in BATCH_POLICIES:
            raise MoepagerError(f"unknown --batch-policy '{self.batch_policy}'; choose from "
                                f"{', '.join(BATCH_POLICIES)}")
        for flag, value in (("--max-num-seqs", self.max_num_seqs), ("--max-batched-tokens", self.max_batched_tokens),
                            ("--kv-cache-tokens", self.kv_cache_tokens), ("--kv-block-size", self.block_size)):
            if not isinstance(value, int) or value < 1:
                raise MoepagerError(f"{flag} must be a positive integer, got {value!r}")
            if value > MAX_COUNT:
                raise MoepagerError(f"{flag} must be at most {MAX_COUNT}, got {value!r}")


@dataclass(frozen=True)
class ExpertFormat:
    """The format routed experts are held and computed in (experts/quant.py)."""

    dtype: str | None = None
    """Format of routed experts: bf16, fp16, fp32 (= the run's dtype), int8 or int4 (lossy, opt-in); None: as
    the checkpoint stores them."""
    int4_group: int | None = None
    """int4: input elements per scale (32, 64, 128; default 32, or a quantized checkpoint's)."""
    int4_zero_point: bool | None = None
    """int4: a zero point per group (default symmetric, or a quantized checkpoint's)."""

    def __post_init__(self) -> None:
        check_expert_options(self.dtype, self.int4_group, self.int4_zero_point)


@dataclass(frozen=True)
class PlacementConfig:
    """Where routed experts compute when this process holds them (moepager/placements/: hybrid, cpu-experts; gpu:
    on --device, resident or paged), and the costs that decide it."""

    execution: Execution = "gpu"
    """Where routed experts compute (experts/hybrid.py): gpu (on the device, a miss copied in), hybrid (a miss
    computed on the CPU in host memory unless copying it pays), cpu-experts (every routed expert on the CPU: llama.cpp's
    --cpu-moe), auto (chosen from the cost model when the run is built, and said why)."""
    hybrid_admit: int = 0
    """Hybrid: up to this many of a layer's experts computed on the CPU are then copied to the device in the
    background (loads ahead, evicting by the policy); 0: the cache changes only through the experts placed on the
    device and prefetches (SMoE's)."""
    hybrid_prefill: HybridPrefill = "ping-pong"
    """Hybrid: how a prefill's experts placed on the device get there (experts/hybrid.py): ping-pong (SMoE's: through
    the two stream rows only, the decode cache left alone, then filled with each layer's most activated experts at
    the first decode pass) or cache (through the cache's slots, evicting as a decode's misses do)."""
    cpu_threads: int | None = None
    """Torch threads of the thread computing experts on the CPU (hybrid, cpu-experts); None: `threads`."""
    profile: str | None = None
    """A calibrated profile (`moepager calibrate --out`) that hybrid placement and `auto` read their costs from;
    None: the nominal figures of planning/cost.py."""

    def __post_init__(self) -> None:
        if self.execution not in EXECUTIONS:
            raise MoepagerError(f"unknown --execution '{self.execution}'; choose from {', '.join(EXECUTIONS)}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise MoepagerError(f"--cpu-threads must be >= 1, got {self.cpu_threads}")
        if self.hybrid_admit < 0:
            raise MoepagerError(f"--hybrid-admit must be >= 0, got {self.hybrid_admit}")
        if self.hybrid_prefill not in HYBRID_PREFILLS:
            raise MoepagerError(f"unknown --hybrid-prefill '{self.hybrid_prefill}'; choose from "
                                f"{', '.join(HYBRID_PREFILLS)}")
        if self.hybrid_admit and self.execution not in ("hybrid", "auto"):
            raise MoepagerError("--hybrid-admit copies the experts hybrid execution computed on the CPU: add "
                                "--execution hybrid")

    @property
    def expert_device(self) -> str | None:
        """Where the routed experts are held and computed when it is not the run's device: the CPU for cpu-experts."""
        return "cpu" if self.execution == "cpu-experts" else None

    def check_with(self, store: StoreConfig, device: str, compiled: bool) -> None:
        """What --execution says of the store's budgets, the device and --compile."""
        execution = self.execution
        on_host = execution in ("hybrid", "cpu-experts")  # routed experts computed on the CPU
        if execution == "hybrid" and store.expert_memory is None:
            raise MoepagerError("--execution hybrid computes the experts missing from the device on the CPU: set "
                                "--expert-memory (the device's share of the experts; with every expert there, "
                                "nothing is missing)")
        if execution == "cpu-experts" and store.expert_memory is not None:
            raise MoepagerError("--execution cpu-experts keeps every routed expert in host memory, none on the "
                                "device: drop --expert-memory (--host-memory budgets host RAM, the rest read from "
                                "disk)")
        if on_host and compiled:
            raise MoepagerError(f"--compile traces the CPU's decode step; --execution {execution} places "
                                "experts between devices: use one or the other")
        if device == "cpu" and store.host_memory is not None and not on_host:
            raise MoepagerError("--host-memory applies to --device cuda; on the CPU experts are computed in RAM, "
                                "so --expert-memory is the RAM budget")


@dataclass(frozen=True)
class RemoteConfig:
    """OD-MoE's worker processes (moepager/placements/remote.py): how many, how their experts are placed and budgeted,
    the shadow, and what a lost one does to the run."""

    workers: int = 0
    """Worker processes that hold and compute the routed experts (OD-MoE; `torchrun ... -m moepager.distributed` or
    `generate --workers N` starts them); 0: none, every expert in this process."""
    worker_group: int | None = None
    """Workers that share one MoE layer's experts (each expert on one of them); None: min(top-k, workers)."""
    worker_memory: str | None = None
    """Each worker's expert cache: a size or a share of its own experts ("25%"); the rest read from the checkpoint
    on demand (OD-MoE's just-in-time loading). None: each holds all of its experts in RAM."""
    worker_assign: WorkerAssign | None = None
    """How a layer call's routed experts go to its group's workers (experts/remote/placement.py): "one-to-one" (OD-MoE:
    no worker takes more than ceil(n / G) of a call's n experts; resident workers hold their group's layers whole),
    "fixed" (each expert on its home worker only). None: one-to-one with --worker-memory (paging workers read any
    expert at no extra memory), fixed without (G times less RAM than one-to-one's copies)."""
    worker_prefill: WorkerPrefill | None = None
    """Which workers compute a prefill pass's layer calls (experts/remote/placement.py): "spread" (OD-MoE §2.7: worker
    i of the W computes expert e of every layer where e mod W = i, so every worker takes part in every layer, not only
    the layer's group) or "group" (as decode passes: the layer's group). None: spread with --worker-memory (a paging
    worker reads what it is asked for), group without (spread would make resident workers hold a second share)."""
    shadow: bool = False
    """--workers: one more process runs the model's int8 copy on the main process's passes and sends each layer's
    routing to the workers as forecasts to load ahead (OD-MoE's shadow model)."""
    align_period: int = 1
    """--shadow: the shadow runs up to `align_period - 1` passes ahead of the main process on tokens of its own (its
    greedy guesses), forecasting those passes' routing early, and is realigned with the main process's tokens at every
    pass it is told of (a wrong guess computed again from the first differing token); 1: it computes only the passes
    it is told of."""
    kv_align_period: int = 0
    """--shadow: every `kv_align_period`-th pass the main process sends the shadow its full-precision KV cache entries
    of the positions it computed since it last sent a request's (every layer), and the shadow overwrites its own
    int8-computed entries with them (OD-MoE's KV alignment, §2.5, whose default is 1). 0 (the default, deliberately
    not the paper's): never, token alignment alone. Measured on the built-in model (benchmarks/README.md#workers),
    alignment every pass left the int8 copy's decode recall where it was (99.59% against 99.57% over 48 tokens) while
    its forecasts reached the workers in time less often (three runs: 1-4 points fewer), and a prompt's entries are
    sent whole at the first decode pass (for Mixtral-8x7B 128 KiB a position, 256 MiB for 2,048 tokens: seconds on
    the paper's 1 Gbps LAN)."""
    on_worker_loss: WorkerLoss = "stop"
    """A worker lost (dead, or silent past the timeout): stop with an error naming it, or give its experts to the
    workers left and go on (needs processes that outlive one another: `generate --workers` starts them so)."""
    worker_timeout_s: float = 60.0
    """How long the main process waits for a worker's answer before it stops with an error naming the worker."""

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise MoepagerError(f"--workers must be >= 0, got {self.workers}")
        if not math.isfinite(self.worker_timeout_s) or not 0 < self.worker_timeout_s <= MAX_WORKER_TIMEOUT_S:
            raise MoepagerError(f"--worker-timeout must be a number of seconds in (0, {MAX_WORKER_TIMEOUT_S:.0f}], "
                                f"got {self.worker_timeout_s}")
        if self.on_worker_loss not in ("stop", "failover"):
            raise MoepagerError(f"--on-worker-loss must be stop or failover, got '{self.on_worker_loss}'")
        if self.on_worker_loss != "stop" and not self.workers:
            raise MoepagerError("--on-worker-loss says what to do when a worker process is lost: add --workers N")
        if self.shadow and not self.workers:
            raise MoepagerError("--shadow forecasts routing for the worker processes: add --workers N")
        if self.align_period < 1 or (self.align_period > 1 and not self.shadow):
            raise MoepagerError(f"--align-period is how many passes the shadow runs ahead plus one (>= 1, with "
                                f"--shadow), got {self.align_period}")
        if self.kv_align_period < 0:
            raise MoepagerError(f"--kv-align-period is every how many passes the shadow's KV cache is realigned (0: "
                                f"never), got {self.kv_align_period}")
        if self.worker_memory is not None and not self.workers:
            raise MoepagerError("--worker-memory budgets the worker processes' experts: add --workers N")
        if self.worker_group is not None and not 1 <= self.worker_group <= max(self.workers, 1):
            raise MoepagerError(f"--worker-group must be between 1 and --workers {self.workers}")
        if self.worker_assign is not None and self.worker_assign not in WORKER_ASSIGNS:
            raise MoepagerError(f"--worker-assign must be {' or '.join(WORKER_ASSIGNS)}, got '{self.worker_assign}'")
        if self.worker_assign is not None and not self.workers:
            raise MoepagerError("--worker-assign places the worker processes' experts: add --workers N")
        if self.worker_prefill is not None and self.worker_prefill not in WORKER_PREFILLS:
            raise MoepagerError(f"--worker-prefill must be {' or '.join(WORKER_PREFILLS)}, got "
                                f"'{self.worker_prefill}'")
        if self.worker_prefill is not None and not self.workers:
            raise MoepagerError("--worker-prefill places the worker processes' prefill work: add --workers N")

    @property
    def assign(self) -> WorkerAssign:
        """`worker_assign`, or its default: one-to-one for paging workers, fixed for resident ones."""
        return self.worker_assign or ("one-to-one" if self.worker_memory is not None else "fixed")

    @property
    def prefill(self) -> WorkerPrefill:
        """`worker_prefill`, or its default: spread for paging workers, group for resident ones."""
        return self.worker_prefill or ("spread" if self.worker_memory is not None else "group")

    def check_with(self, store: StoreConfig, execution: Execution, compiled: bool) -> None:
        """What --workers says of the store's budgets, --execution and --compile."""
        if self.workers and (store.paged or execution != "gpu" or compiled):
            raise MoepagerError("--workers holds every routed expert on the worker processes (CPU, gloo): drop "
                                "--expert-memory/--host-memory, --execution and --compile")


@dataclass(frozen=True)
class EngineConfig:
    """What to run and where."""

    model: str | None = None
    """Checkpoint directory; None runs the built-in default model."""
    dtype: str | None = None
    """Compute dtype (bfloat16, float16, float32); None keeps the checkpoint's."""
    device: str = "cpu"
    """Where the model computes: cpu or cuda[:N]."""
    threads: int | None = None
    """CPU threads for torch; None keeps torch's default."""
    store: StoreConfig = field(default_factory=StoreConfig)
    """Expert memory budgets and paging."""
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    """Routing prediction and prefetch."""
    expert_kernel: Kernel = "auto"
    """How a layer's routed experts are computed (experts/executor.py): one of KERNELS."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Continuous batching and the KV cache."""
    experts: ExpertFormat = field(default_factory=ExpertFormat)
    """The routed experts' format (as the checkpoint stores them by default)."""
    dense_dtype: str | None = None
    """int8: the dense projections (attention, dense and shared MLPs, LM head) as int8 too (lossy, opt-in);
    None: they compute in `dtype`."""
    pack_dense: bool = True
    """CPU, bf16: dense projections on moepager's GEMV (else oneDNN's prepacked weights: accel/packed.py) and the
    norms, routers and decode attention on moepager's step kernels (accel/step.py); False keeps torch's own ops."""
    compile: bool = False
    """CPU: decode passes (one token a row, one row or several) run a TorchInductor-compiled graph, which computes
    small resident experts itself and leaves it at each MoE layer for any other executor, paged ones included
    (accel/compiled.py; opt-in: not bit-equal to the eager forward)."""

    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Where routed experts compute in this process (--execution and its options)."""
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    """Worker processes holding the routed experts (--workers and its options; none by default)."""

    cuda_graphs: bool = True
    """CUDA: one-request decode steps replay a CUDA graph where they can be captured (every expert resident in
    bf16, nothing observing routing: runtime/cuda_graphs.py); the same tokens as launching each kernel."""

    @property
    def fit_decides(self) -> bool:
        """Whether the automatic fit sizes the expert budget (placements/fit.py; `fit_decides`)."""
        return fit_decides(self.store.paged, self.remote.workers, self.placement.execution)

    def __post_init__(self) -> None:
        if self.prefetch.predictor is not None and not self.store.paged and self.remote.worker_memory is None \
                and not self.fit_decides:
            raise MoepagerError("prefetching needs a paged store: set --expert-memory (with every expert resident "
                                "there is nothing to prefetch), or --workers with --worker-memory")
        check_dense_name(self.dense_dtype)
        if self.expert_kernel not in KERNELS:
            raise MoepagerError(f"unknown expert kernel '{self.expert_kernel}'; choose from {', '.join(KERNELS)}")
        if self.threads is not None and self.threads < 1:
            raise MoepagerError(f"--threads must be >= 1, got {self.threads}")
        self.remote.check_with(self.store, self.placement.execution, self.compile)
        self.placement.check_with(self.store, self.device, self.compile)
        check_device(self.device)


def fit_decides(paged: bool, workers: int, execution: str) -> bool:
    """Whether the automatic fit sizes the expert budget (placements/fit.py): none given (not `paged`), and the routed
    experts computed in this process, where it holds them. Such a run pages its experts or keeps them all resident as
    the machine's memory decides, after its configuration is made, so options that act on paged experts are taken."""
    return not paged and not workers and execution in ("gpu", "auto")


def check_device(device: str) -> None:
    """The device exists here."""
    if not (device == "cpu" or device.startswith("cuda")):
        raise MoepagerError(f"device '{device}' is not supported; use cpu or cuda[:N]")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise MoepagerError(f"device '{device}' requested but CUDA is not available")
