"""The automatic fit: a run given no expert budget (no --expert-memory, no --host-memory) sizes its expert cache from
the memory it may use, so a model bigger than the machine pages its experts from disk instead of being killed.

Algorithm (CPU; on CUDA the device's free memory takes RAM's place for the device tier):
1. The memory this run may use: what the machine reports available now (`psutil`: RAM not taken by anyone, page
   cache that can be dropped), within the cgroup's limit less its usage when the process runs under one (a
   container; cgroup v2 `memory.max` or v1 `memory.limit_in_bytes`), less the shared libraries mapped into the
   process (their pages count in its RSS, and in neither figure: store/budget.py `mapped_libraries`); or
   `MOEPAGER_MEMORY_AVAILABLE` when set.
2. What the run needs besides routed experts, first: the dense weights in the run's dtype, the KV cache at
   --kv-cache-tokens, a step's working memory (`step_bytes`: its --max-batched-tokens' activations, logits and
   attention scores over the whole cache), and a headroom left free for the allocator and the OS (`HEADROOM`).
3. Every routed expert fits in what is left (with no read buffers: nothing is read later): they stay resident, as
   without a fit. Otherwise what is left is the expert budget: the store's cache, stream rows and read buffers come
   out of it, the rest is read from disk on demand. A budget below one MoE layer's top-k experts (the least a
   decode step holds) is refused before anything loads, with the numbers.
4. A run that pages from disk times a few reads of random experts through its own reader (`disk_rate`) and says what
   the disk gives a decode token: the missing experts' bytes where routing spreads evenly over the experts, and the
   seconds they take at the rate measured. Below `SLOW_DISK_BPS` the line says the disk is slow and what reads less.
`--expert-memory all` keeps its own meaning (every expert through the store); a budget a user gives is never fitted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from moepager.config import EngineConfig, SchedulerConfig
from moepager.errors import BudgetError
from moepager.experts.hybrid import ExpertTimes
from moepager.loading.build import OpenCheckpoint
from moepager.models.attention import SCORES_MAX
from moepager.placements.stores import STREAM_ROWS, read_buffer_bytes
from moepager.planning.calibrate import parallel_rate
from moepager.store.budget import format_bytes, ram_available
from moepager.types import ExpertKey, RoutingDecision

HEADROOM_SHARE, HEADROOM_MIN = 0.10, 256 << 20
"""Of the memory a run may use, what a fit leaves free: a tenth, and at least 256 MiB (activations of a prefill
chunk, the allocator's slack, the OS)."""


def headroom(available: int) -> int:
    return max(int(HEADROOM_SHARE * available), HEADROOM_MIN)


@dataclass(frozen=True)
class Fit:
    """What the fit found and chose (bytes)."""

    where: str
    """The memory fitted: "RAM" or "GPU memory"."""
    available: int
    """What this run may use."""
    source: str
    """Where `available` came from."""
    dense: int
    """The dense weights in the run's dtype (on the device fitted)."""
    kv: int
    """The KV cache at --kv-cache-tokens."""
    working: int
    """A step's working memory (`step_bytes`)."""
    headroom: int
    experts: int
    """Every routed expert in the run's format."""
    least: int
    """The least expert budget a run takes: one MoE layer's top-k experts, the stream rows and the read buffers."""

    @property
    def left(self) -> int:
        """What the experts may take."""
        return self.available - self.dense - self.kv - self.working - self.headroom

    @property
    def resident(self) -> bool:
        return self.experts <= self.left

    @property
    def budget(self) -> int | None:
        """The expert budget a fit gives (None: every expert resident)."""
        return None if self.resident else self.left

    def needs(self) -> str:
        """The memory and what comes out of it before the experts, for people."""
        return (f"{format_bytes(self.available)} {self.where} {self.source}, less {format_bytes(self.dense)} of dense "
                f"weights, {format_bytes(self.kv)} of KV cache, {format_bytes(self.working)} of a step's working "
                f"memory and {format_bytes(self.headroom)} of headroom")

    def describe(self) -> str:
        """One line: what was chosen and why."""
        if self.resident:
            return f"fit: every routed expert resident ({format_bytes(self.experts)}; {self.needs()})"
        return (f"fit: --expert-memory {format_bytes(self.left)} of the experts' {format_bytes(self.experts)}, the "
                f"rest read from disk on demand ({self.needs()}; --expert-memory sets it)")

    def check(self) -> None:
        if self.left < self.least:
            raise BudgetError(
                f"this model does not fit here: {self.needs()}, leaves {format_bytes(max(self.left, 0))} for experts, "
                f"below the least a decode step needs ({format_bytes(self.least)}: one MoE layer's top-k, stream rows "
                "and read buffers); free memory, lower --kv-cache-tokens, or use a smaller --dtype or --expert-dtype")


def step_bytes(opened: OpenCheckpoint, tokens: int, context: int, rows: int) -> int:
    """What one step of `tokens` tokens (--max-batched-tokens) of up to `rows` requests holds beyond the weights and
    the KV cache, at most: 32 hidden-sized fp32 rows a token (its activations, and what the C heap keeps between
    them), its routed experts' gate/up/down rows and the widest dense or shared MLP's, fp32 logits for each request's
    last token, and one attention call's scores over `context` positions (--kv-cache-tokens: fp32 with their softmax,
    ~10 bytes each, in row blocks of at most models/attention.py SCORES_MAX). What a prompt's steps held on
    DeepSeek-V2-Lite, prompt after prompt, against this term: benchmarks/README.md#bigger_than_ram."""
    cfg = opened.config
    widest = max(cfg.dense_intermediate_size if len(cfg.moe_layers) < cfg.num_layers else 0,
                 cfg.shared_intermediate_size)  # a dense layer's or the shared experts' MLP, whichever is wider
    per_token = 4 * (32 * cfg.hidden_size + 3 * cfg.top_k * cfg.expert_intermediate_size + 3 * widest)
    scores = min(cfg.num_heads * tokens * context, max(SCORES_MAX, cfg.num_heads * context))
    return tokens * per_token + rows * 4 * cfg.vocab_size + 10 * scores


PREFILL_CHUNKS = (512, 1024, 2048, 4096)
"""Prompt chunk sizes a fit that pages experts from disk on the CPU chooses among (`prefill_chunk`)."""
CHUNK_MEMORY_SHARE = 8
"""A larger chunk's working memory may take at most 1/8 of the expert budget the fit had at the default chunk."""


def prefill_chunk(fit: Fit, opened: OpenCheckpoint, config: EngineConfig, times: ExpertTimes) -> int:
    """The prompt chunk of a run whose experts page from disk: each chunk reads its layers' missing experts once (a
    chunk of a few tokens per expert touches nearly all of them), so the reads of a prompt fall with its chunk count.
    The cost model's per-layer figures: a chunk of T tokens computes E experts of T*k/E tokens each and reads the
    E*(1 - cached share) it misses; the chosen chunk is the smallest from the default up (PREFILL_CHUNKS) whose
    compute covers its reads (they overlap), short of the first whose working memory passes 1/CHUNK_MEMORY_SHARE of
    the budget. On DeepSeek-V2-Lite with half its experts cached, a 512-token chunk computes in well under its reads
    and a 4,096-token one in more (the cost model's nominal CPU figures)."""
    paging, default = opened.paging, config.scheduler.max_batched_tokens
    assert fit.budget is not None
    share = min(1.0, fit.budget / fit.experts)
    reads = paging.num_experts * (1 - share) * times.copy_s

    def covers(chunk: int) -> bool:
        return paging.num_experts * times.cpu_s(max(1, chunk * paging.top_k // paging.num_experts)) >= reads

    chosen, cap = default, fit.budget // CHUNK_MEMORY_SHARE
    for chunk in (c for c in PREFILL_CHUNKS if c > default):
        if covers(chosen) or step_bytes(opened, chunk, config.scheduler.kv_cache_tokens,
                                         config.scheduler.max_num_seqs) > cap:
            break
        chosen = chunk
    return chosen


def kv_cache_bytes(opened: OpenCheckpoint, tokens: int, block_size: int) -> int:
    """The KV cache's bytes at `tokens` positions: its blocks' shapes from the model built on the meta device."""
    with torch.device("meta"):
        model = opened.arch.build(opened.config, _NoExperts())
    return model.cache_bytes(tokens, block_size, opened.dtype)


class _NoExperts:
    """The executor of a model built on the meta device to size its KV cache (never run)."""

    compute_note = ""

    def run(self, layer: int, x_ND: torch.Tensor, route: RoutingDecision) -> torch.Tensor:
        raise AssertionError("a meta model sizes its cache; it never runs")


def fit_of(config: EngineConfig, opened: OpenCheckpoint, device_free: int | None = None) -> Fit:
    """The fit of this run on this machine (`device_free`: a CUDA device's free bytes, which the device tier fits)."""
    paging, reader = opened.paging, opened.reader
    experts = paging.num_moe_layers * paging.num_experts * reader.shape.nbytes
    dense = opened.total_bytes() - experts
    kv = kv_cache_bytes(opened, config.scheduler.kv_cache_tokens, config.scheduler.block_size)
    working = step_bytes(opened, config.scheduler.max_batched_tokens, config.scheduler.kv_cache_tokens,
                         config.scheduler.max_num_seqs)
    store = config.store
    least = (paging.top_k + STREAM_ROWS) * reader.shape.nbytes + \
        read_buffer_bytes(reader, store.io_threads, store.prefetch_threads)
    if device_free is not None:
        available, source, where = device_free, "free", "GPU memory"
    else:
        (available, source), where = ram_available(), "RAM"
    return Fit(where, available, source, dense, kv, working, headroom(available), experts, least)


PAGING_OPTIONS = {"policy": "--policy", "scope": "--cache-scope", "io_threads": "--io-threads",
                  "direct_io": "--direct-io", "warm": "--cold", "prefetch_threads": "--prefetch-threads",
                  "prefetch_policy": "--prefetch-policy", "prefetch_yields": "--prefetch-no-yield"}
"""The store's options that act only on experts it pages (field: flag)."""


PROBE_READS, PROBE_BYTES, PROBE_S = 16, 64 << 20, 0.5
"""`disk_rate` reads at least this many random experts and this many bytes, and starts no read after this many
seconds: enough that a throttled or networked disk's first burst does not pass for its rate."""
SLOW_DISK_BPS = 250e6
"""A disk reading random experts below this rate is said to be slow: a SATA SSD reads about twice it, a hard disk's
seeks or a network file system fall below it."""


def disk_rate(opened: OpenCheckpoint, io_threads: int, seconds: float = PROBE_S) -> float:
    """Bytes/s reading random routed experts from the checkpoint through the run's reader (O_DIRECT where the file
    system allows it), as `moepager calibrate` measures it (planning/calibrate.py `parallel_rate`): PROBE_READS reads
    and PROBE_BYTES at least, none started after `seconds` but each thread's first. Random experts, as misses are:
    neighbours in file order would flatter the disk."""
    paging = opened.paging
    reads = max(PROBE_READS, min(-(-PROBE_BYTES // opened.reader.shape.nbytes), 4096))
    pick = random.Random(0)
    keys = [ExpertKey(pick.choice(paging.moe_layers), pick.randrange(paging.num_experts)) for _ in range(reads)]
    return parallel_rate(opened.reader, keys, io_threads, seconds)


def disk_note(fit: Fit, opened: OpenCheckpoint, budget: int, rate: float) -> str:
    """The fit's clause on the disk: its measured rate and what a decode token waits on it where routing spreads
    evenly (each MoE layer's top-k experts, a share `budget / experts` of them cached), slow or not."""
    paging, nbytes = opened.paging, opened.reader.shape.nbytes
    missing = paging.num_moe_layers * paging.top_k * max(0.0, 1 - budget / fit.experts) * nbytes
    wait = missing / rate
    waits = f"{wait * 1e3:.0f} ms" if wait < 1 else f"{wait:.2f} s"
    said = (f"the disk reads {rate / 1e9:.2f} GB/s (random experts), so a decode token waits about {waits} for its "
            f"{format_bytes(missing)} of missing experts where routing spreads evenly")
    if rate >= SLOW_DISK_BPS:
        return f"; {said}"
    return (f"; slow disk: {said} (below {SLOW_DISK_BPS / 1e9:.2f} GB/s; a faster disk for the checkpoint, more "
            f"memory, or a smaller --expert-dtype reads less)")


def unused_paging(config: EngineConfig) -> str:
    """The paging options `config` sets that a fitted run keeping every expert resident leaves unused, as a clause for
    the fit's line ("" when none): a fitted run may page on one machine and not on another, so they are not refused."""
    default = type(config.store)()
    given = [flag for name, flag in PAGING_OPTIONS.items() if getattr(config.store, name) != getattr(default, name)]
    if config.prefetch.predictor is not None:
        given.insert(0, f"--predictor {config.prefetch.predictor}")
    return f"; {', '.join(given)} unused: nothing is paged" if given else ""


def fitted(config: EngineConfig, opened: OpenCheckpoint, times: ExpertTimes | None = None
           ) -> tuple[EngineConfig, str]:
    """The run's configuration with the expert budget the fit gives (unchanged when every expert fits, or when it is
    not fitted: `fits`), and the fit's line ("" when not fitted). On CUDA the device tier is fitted to the device's
    free memory, and a host tier that cannot hold every expert to RAM. On the CPU, a run paging from disk at the
    default --max-batched-tokens has its prompts chunked as `prefill_chunk` chooses from `times` (the cost model's
    expert figures), the budget then fitted again with that chunk's working memory."""
    if not config.fit_decides:
        return config, ""
    cuda = opened.device.type == "cuda"
    fit = fit_of(config, opened, torch.cuda.mem_get_info(opened.device)[0] if cuda else None)
    if fit.kv > fit.available - fit.dense:  # the KV cache alone does not fit: its own check refuses it with
        return config, ""                   # --kv-cache-tokens' message (runtime/kv_pool.py)
    fit.check()
    if fit.budget is None:
        return config, fit.describe()
    chunk = ""
    if not cuda and times is not None and config.scheduler.max_batched_tokens == SchedulerConfig().max_batched_tokens:
        tokens = prefill_chunk(fit, opened, config, times)
        if tokens != config.scheduler.max_batched_tokens:
            config = replace(config, scheduler=replace(config.scheduler, max_batched_tokens=tokens))
            fit = replace(fit, working=step_bytes(opened, tokens, config.scheduler.kv_cache_tokens,
                                                  config.scheduler.max_num_seqs))  # the same memory, not measured again
            fit.check()
            chunk = (f"; prompts in chunks of {tokens} tokens (each reads its layers' missing experts once; "
                     "--max-batched-tokens sets it)")
    if fit.budget is None:
        return config, fit.describe()
    store, line = replace(config.store, expert_memory=str(fit.budget)), fit.describe() + chunk
    reads, budget = fit, fit.budget  # the tier whose misses are read from disk (None: none is), and its budget
    if cuda:  # the host tier below: every expert in RAM, the dense weights and KV cache on the device
        ram, source = ram_available()
        host = replace(fit, where="RAM", available=ram, source=source, dense=0, kv=0, working=0, headroom=headroom(ram))
        if host.resident:
            reads = None
        else:
            reads, budget = host, max(host.left, fit.least)
            store = replace(store, host_memory=str(budget))
            line += f"; host tier {host.describe()}"
    if reads is not None:
        line += disk_note(reads, opened, budget, disk_rate(opened, store.io_threads))
    return replace(config, store=store), line
