"""The composition root: one EngineConfig -> checkpoint reader -> expert store -> executor -> model -> prefetcher.

Nothing below this module builds a collaborator of its own: the tiers receive their policies, the model
receives a built executor, the prefetcher receives the store. The expert store is built here too: budgets -> slot
counts -> arenas -> tiers -> warm start. Checks before anything is allocated: the policy and predictor names
against their registries, each budget holds at least one MoE layer's top-k experts (the most a decode step pins at
once), and the arenas fit in the memory that is actually free (RAM, pinned RAM, GPU).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import torch

from moepager.accel import cpu_kernels
from moepager.checkpoints.build import (
    ExecutorFactory,
    LoadedModel,
    LoadOptions,
    OpenCheckpoint,
    build_model,
    load_bar,
    open_checkpoint,
    read_experts,
    resident_executor,
)
from moepager.checkpoints.derived import SplitLayout
from moepager.config import Budget, EngineConfig, Execution, Kernel, StoreConfig
from moepager.errors import BudgetError, ConfigError
from moepager.experts.executor import ArenaKernels, ExpertExecutor, PagedExecutor
from moepager.experts.hybrid import CpuExpertsExecutor, CpuPool, ExpertTimes, HybridExecutor
from moepager.experts.protocols import FlatReader
from moepager.experts.remote.executor import RemoteExecutor
from moepager.experts.remote.placement import Links, Placement
from moepager.experts.remote.protocol import SHADOW_RANK
from moepager.experts.remote.worker import ExpertWorker
from moepager.experts.split import SplitExecutor
from moepager.models.config import ModelConfig
from moepager.planning.configurator import layer_costs
from moepager.planning.cost import CostModel, nominal_profile
from moepager.policies import UnknownPolicyError, make_policy, policy_spec
from moepager.policies.base import ForecastConsumer
from moepager.policies.prefetch import PREFETCH_POLICIES, PrefetchAware, make_prefetch_policy
from moepager.predictors import PREDICTORS
from moepager.runtime.configure import OnlineConfigurator
from moepager.runtime.prefetch import Prefetcher, build_prefetcher
from moepager.store.budget import check_slots, format_bytes, share_quotas
from moepager.store.parts import PartForecasts, WholeExperts
from moepager.store.slots import SlotTable
from moepager.store.stats import StoreReport
from moepager.store.store import ExpertStore
from moepager.store.tiers import Tier
from moepager.store.transfer import Transfers
from moepager.store.view import StoreView
from moepager.types import ExpertKey, Scope, host_empty

STREAM_ROWS = 2
"""Device rows, out of the budget, that experts a layer needs beyond its cache stream through (two: one loads
while the other is computed with, SMoE's ping-pong buffers)."""
RAM_HEADROOM = 0.9
"""Share of the currently available RAM that expert buffers may take (the rest is for activations, OS)."""


def budget_slots(budget: Budget, flag: str, cfg: ModelConfig, expert_nbytes: int, reserved_bytes: int = 0) -> int:
    """Experts that `budget` holds beside `reserved_bytes` of read buffers, checked against the minimum (one MoE
    layer's top-k)."""
    slots = budget.slots(expert_nbytes, cfg.num_moe_layers * cfg.num_experts, reserved_bytes)
    check_slots(slots, cfg.top_k, expert_nbytes, flag, budget.text, reserved_bytes)
    return slots


def read_buffer_bytes(reader: FlatReader, io_threads: int, prefetch_threads: int = 1) -> int:
    """What the threads reading experts from disk allocate (bounce and conversion buffers): every I/O thread
    and every thread of the prefetch lane. It comes out of the budget of the tier disk reads fill."""
    return (io_threads + prefetch_threads) * reader.buffer_bytes_per_thread()


def warm_order(layers: Sequence[int], num_experts: int, quotas: dict[int, int] | None = None,
               cacheable: Callable[[ExpertKey], bool] | None = None, rest: bool = True) -> list[ExpertKey]:
    """Expert 0 of every layer, then expert 1 of every layer, ...: any prefix respects even per-layer quotas; with
    `quotas` (a configured split), each layer's first quota experts in that order, and then (`rest`: in scope "global";
    in scope "layer" a layer past its quota would evict its own) the others; `cacheable`: only the experts (a split
    checkpoint's parts) a cache may hold."""
    order = [ExpertKey(layer, e) for e in range(num_experts) for layer in layers]
    if cacheable is not None:
        order = [k for k in order if cacheable(k)]
    if quotas is None:
        return order
    counts, first, others = dict.fromkeys(layers, 0), [], []
    for k in order:
        counts[k.layer] += 1
        (first if counts[k.layer] <= quotas[k.layer] else others).append(k)
    return first + others if rest else first


def read_plan(path: str, cfg: ModelConfig) -> tuple[list[float], list[float]]:
    """The per-layer budgets and split ratios θ of a `moepager plan --json` file (θ 1 where it has none)."""
    import json

    try:
        plan = json.loads(Path(path).read_text())
        budgets = [float(b) for b in plan["budgets"]]
        theta = [float(t) for t in plan.get("theta", [1.0] * len(budgets))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"--layer-plan {path}: not a `moepager plan --json` file ({e})") from None
    layers = cfg.num_moe_layers
    if len(budgets) != layers or len(theta) != layers or min(budgets) < 0 or sum(budgets) <= 0:
        raise ConfigError(f"--layer-plan {path} has budgets for {len(budgets)} layers; this model has {layers} MoE "
                          "layers (plan on a trace of this model)")
    if not all(0 < t <= 1 for t in theta):
        raise ConfigError(f"--layer-plan {path}: split ratios must lie in (0, 1], got {theta}")
    return budgets, theta


def cached_parts(plan: str | None, theta: Sequence[float], cfg: ModelConfig, split: SplitLayout | None
                 ) -> dict[int, int]:
    """Each MoE layer's top parts a split checkpoint caches: the θ_i of the `--layer-plan` (`plan`) rounded to the
    nearest part (at least one), all of them without one; a plan that splits experts needs a split checkpoint."""
    if split is None:
        if min(theta) < 1:
            raise ConfigError(f"--layer-plan {plan} splits experts (θ down to {min(theta):.2f}) and this checkpoint "
                              "stores them whole: write a split copy with `moepager split --model MODEL --parts 4 "
                              "--out DIR` and run that, or plan with --whole-experts")
        return {layer: 1 for layer in cfg.moe_layers}
    return {layer: max(1, min(split.parts, round(t * split.parts))) for layer, t in zip(cfg.moe_layers, theta)}


def _check_fits(nbytes: int, device: torch.device, what: str) -> None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if nbytes > free:
            raise BudgetError(f"{what} needs {format_bytes(nbytes)} of GPU memory but {format_bytes(free)} is free; "
                              f"lower --expert-memory")
        return
    available = psutil.virtual_memory().available * RAM_HEADROOM
    if nbytes > available:
        raise BudgetError(f"{what} needs {format_bytes(nbytes)} of RAM for its buffers but only "
                          f"{format_bytes(available)} is available; lower the budget")


def stream_rows(slots: int, num_routed: int) -> int:
    """Rows of a device budget of `slots` experts (of `num_routed` in all) that stream experts through instead
    of caching them: none when the budget holds every expert (no layer ever needs more than it holds)."""
    return 0 if slots >= num_routed else min(STREAM_ROWS, slots)


def _tier(slots: int, cfg: ModelConfig, reader: FlatReader, device: torch.device, config: StoreConfig,
          pin: bool, what: str, streams: int = 0, scope: Scope | None = None, prefetch_aware: bool = False,
          quotas: Sequence[int] | None = None) -> Tier:
    """`slots` rows of buffers: the last `streams` of them stream rows, the rest the cache."""
    shape = reader.shape
    _check_fits(slots * shape.nbytes, device, what)
    arena = host_empty(slots, shape.numel, dtype=shape.buffer_dtype) if device.type == "cpu" and not pin else \
        torch.empty(slots, shape.numel, dtype=shape.buffer_dtype, device=device, pin_memory=pin)
    policy = make_policy(config.policy, engine=True)
    table = SlotTable(slots - streams, cfg.moe_layers,  # the device tier: prefetches share its cache
                      make_prefetch_policy(config.prefetch_policy, policy) if prefetch_aware else policy,
                      scope or config.scope, streams, quotas)
    return Tier(table, arena)


def build_store(config: StoreConfig, reader: FlatReader, cfg: ModelConfig, device: torch.device,
                host_tier: bool, progress: Callable[[int], None] | None = None,
                split: SplitLayout | None = None) -> ExpertStore:
    """Device slots (budget `expert_memory`, default all) over a host tier (`host_tier`; budget `host_memory`,
    default all) or straight over disk. `split`: the checkpoint's experts in parts (`cfg` its paging
    configuration), each layer caching its top parts and streaming the rest through stream rows inside the budget,
    enough for a decode step's bottoms to load at once."""
    nbytes, buffers = reader.shape.nbytes, read_buffer_bytes(reader, config.io_threads, config.prefetch_threads)
    reserved = 0 if host_tier else buffers
    device_slots = budget_slots(config.device_budget, "--expert-memory", cfg, nbytes, reserved) if split is None else \
        config.device_budget.slots(nbytes, cfg.num_moe_layers * cfg.num_experts, reserved)  # split: checked below
    host = None
    if host_tier:
        host_slots = budget_slots(config.host_budget, "--host-memory", cfg, nbytes, buffers)
        # the host tier is one cache for all layers: the device tier above it keeps the per-layer quotas
        host = _tier(host_slots, cfg, reader, torch.device("cpu"), config, device.type == "cuda",
                     f"--host-memory {config.host_memory or 'all'} ({host_slots} experts)", scope="global")
    streams = stream_rows(device_slots, cfg.num_moe_layers * cfg.num_experts)
    budgets, theta = read_plan(config.layer_plan, cfg) if config.layer_plan else (None, [1.0] * cfg.num_moe_layers)
    tops = cached_parts(config.layer_plan, theta, cfg, split)
    least, most = [cfg.top_k] * cfg.num_moe_layers, [cfg.num_experts] * cfg.num_moe_layers
    if split is not None:  # each layer's top parts of a decode step's experts cached, its bottoms streaming at once
        least = [split.top_k * tops[layer] for layer in cfg.moe_layers]
        most = [split.experts * tops[layer] for layer in cfg.moe_layers]
        streams = max(streams, split.top_k * (split.parts - min(tops.values())))
        if device_slots - streams < max(least) and config.expert_memory is not None:  # as whole experts: one layer's
            need = format_bytes((max(least) + streams) * nbytes + reserved)
            raise BudgetError(f"--expert-memory {config.expert_memory} holds {device_slots} parts: split experts need "
                              f"a layer's top parts of its top-{split.top_k} experts ({max(least)}) and {streams} "
                              f"parts streaming, at least {need}")
    quotas = share_quotas(budgets, device_slots - streams, least, most) if budgets is not None else None
    tier = _tier(device_slots, cfg, reader, device, config, False,
                 f"--expert-memory {config.expert_memory or 'all'} ({device_slots} experts)", streams,
                 prefetch_aware=True, quotas=quotas)
    transfers = Transfers(device, config.io_threads, config.prefetch_threads, config.prefetch_yields)
    store = ExpertStore(tier, host, reader.read, transfers, buffers,
                        getattr(reader, "read_many", None) if split is not None else None)
    if split is not None:
        store.split(split.parts, tops)
    if config.warm:  # a split checkpoint's cacheable parts only, each layer's quota first
        parts = split.parts if split is not None else 1
        store.warm(warm_order(cfg.moe_layers, cfg.num_experts, store.device.table.quota if quotas or split else None,
                              (lambda k: k.expert % parts < tops[k.layer]) if split is not None else None,
                              config.scope == "global"), progress)
    return store


def paged_executor(config: StoreConfig, device: torch.device, kernel: Kernel = "auto",
                   host_tier: bool | None = None) -> ExecutorFactory:
    """A load_model executor factory for the store; `host_tier` defaults to whether the device is CUDA."""
    def make(reader: FlatReader, cfg: ModelConfig, progress: Callable[[int], None]) -> ExpertExecutor:
        return _paged(config, reader, cfg, device, kernel, device.type == "cuda" if host_tier is None else host_tier,
                      progress)
    return make


def _paged(config: StoreConfig, reader: FlatReader, cfg: ModelConfig, device: torch.device, kernel: Kernel,
           host_tier: bool, progress: Callable[[int], None]) -> PagedExecutor:
    if reader.shape.quant is not None and reader.stored is None:
        print(f"warning: paging {reader.shape.format_name} experts out of a float checkpoint reads float bytes "
              "and quantizes every miss; `moepager quantize` writes a checkpoint that reads the quantized "
              "bytes", file=sys.stderr)
    fused = cpu_kernels.fused_experts(reader.shape, device, kernel)
    return PagedExecutor(build_store(config, reader, cfg, device, host_tier, progress, getattr(reader, "split", None)),
                         reader.shape, kernel, fused)


def check_names(config: EngineConfig) -> None:
    """The policy and predictor names against their registries (config.py cannot see them), before anything loads."""
    try:
        policy_spec(config.store.policy, engine=True)  # the tiers build it
    except UnknownPolicyError as e:
        raise ConfigError(str(e)) from None
    if config.store.prefetch_policy not in PREFETCH_POLICIES:
        raise ConfigError(f"unknown prefetch policy '{config.store.prefetch_policy}'; choose from "
                          f"{', '.join(PREFETCH_POLICIES)}")
    name = config.prefetch.predictor
    if name is not None and name not in PREDICTORS:
        raise ConfigError(f"unknown predictor '{name}'; choose from {', '.join(PREDICTORS)}")


@dataclass
class Built:
    """What `build` composed: the model with its executor, and the store and prefetcher when experts are paged."""

    loaded: LoadedModel
    store: ExpertStore | None
    prefetcher: Prefetcher | None
    configurator: OnlineConfigurator | None = None
    """`--configure auto`: per-layer cache sizes chosen again as the run goes (a pass part and routing observer)."""


def expert_times(config: EngineConfig, device: torch.device, expert_bytes: int) -> tuple[ExpertTimes, str]:
    """What an expert costs on the CPU, on the device and to copy over (`--profile`, else the nominal figures of
    the device's kind), and the profile's name."""
    name = config.profile or nominal_profile(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    try:
        return CostModel.profile(name, expert_bytes).expert_times(on_cpu=device.type == "cpu"), name
    except ValueError as e:
        raise ConfigError(str(e)) from None


def resolve_execution(config: EngineConfig, device: torch.device, times: ExpertTimes, profile: str
                      ) -> tuple[Execution, str]:
    """`--execution auto` made concrete, and why (the others as they are)."""
    if config.execution != "auto":
        return config.execution, ""
    if device.type == "cpu":
        return "gpu", "auto: no GPU, every expert computes on the CPU where its slot is"
    if config.store.expert_memory is None:
        return "gpu", "auto: every routed expert is on the device"
    cpu, copied = times.cpu_s(1), times.device_s(1) + times.copy_s
    choice: Execution = "hybrid" if cpu < copied else "gpu"
    return choice, (f"auto: {choice}, a decode's missing expert takes {cpu * 1e3:.2f} ms on the CPU against "
                    f"{copied * 1e3:.2f} ms copied and computed on the device ({profile})")


def hybrid_executor(config: EngineConfig, device: torch.device, times: ExpertTimes | None = None) -> ExecutorFactory:
    """A load_model executor factory for `--execution hybrid` (`times`: the placement's costs; default the run's
    profile's)."""
    def make(reader: FlatReader, cfg: ModelConfig, progress: Callable[[int], None]) -> ExpertExecutor:
        return _hybrid(config, reader, cfg, device, times or expert_times(config, device, reader.shape.nbytes)[0],
                       progress)
    return make


def _hybrid(config: EngineConfig, reader: FlatReader, cfg: ModelConfig, device: torch.device, times: ExpertTimes,
            progress: Callable[[int], None]) -> HybridExecutor:
    """Device slots at --expert-memory over a host tier (--host-memory, default every expert), even on a CPU run,
    whose 'device' is then RAM computed by the calling thread (the data path, tested without a GPU)."""
    kernel = config.expert_kernel
    store = build_store(config.store, reader, cfg, device, True, progress)
    return HybridExecutor(store, reader.shape, kernel, cpu_kernels.fused_experts(reader.shape, device, kernel),
                          cpu_kernels.fused_experts(reader.shape, torch.device("cpu"), kernel), times,
                          CpuPool(config.cpu_threads or config.threads), config.hybrid_admit)


def cpu_experts_executor(config: EngineConfig, device: torch.device) -> ExecutorFactory:
    """A load_model executor factory for `--execution cpu-experts`: every routed expert in host RAM (--host-memory,
    the rest paged from disk) computed on the CPU."""
    def make(reader: FlatReader, cfg: ModelConfig, progress: Callable[[int], None]) -> ExpertExecutor:
        cpu, kernel = torch.device("cpu"), config.expert_kernel
        if config.store.host_memory is not None:  # host RAM as a CPU run's device tier, over disk
            store_config = replace(config.store, expert_memory=config.store.host_memory, host_memory=None)
            inner: ExpertExecutor = _paged(store_config, reader, cfg, cpu, kernel, False, progress)
        else:
            inner = resident_executor(cpu, kernel)(reader, cfg, progress)  # type: ignore[arg-type]
        return CpuExpertsExecutor(inner, device, CpuPool(config.cpu_threads or config.threads))
    return make


def placement(config: EngineConfig, cfg: ModelConfig) -> Placement:
    """Which worker holds each expert (experts/remote/placement.py), checked against the processes that were started."""
    import torch.distributed as dist

    processes = config.workers + 1 + config.shadow
    if not dist.is_initialized() or dist.get_world_size() != processes:
        raise ConfigError(f"--workers {config.workers} needs {processes} processes started together: run "
                          f"`moepager generate --workers {config.workers} ...` or `torchrun --nproc-per-node "
                          f"{processes} -m moepager.distributed generate ...`")
    first = 2 if config.shadow else 1  # rank 1 is the shadow's
    return Placement(tuple(range(first, first + config.workers)),
                     config.worker_group or min(cfg.top_k, config.workers))


def remote_executor(config: EngineConfig, reader: FlatReader, cfg: ModelConfig, links: Links) -> RemoteExecutor:
    """The main rank's executor: routed experts computed by the worker ranks, each on its link."""
    shape = reader.shape
    return RemoteExecutor(shape, cfg.moe_layers, cfg.num_experts, placement(config, cfg),
                          cpu_kernels.fused_experts(shape, torch.device("cpu"), config.expert_kernel),
                          config.worker_timeout_s, config.on_worker_loss,
                          also_placed=(SHADOW_RANK,) if config.shadow else (),
                          links=links, priority=PrefetchAware.priority)


def expert_worker(config: EngineConfig, path: Path, rank: int, links: Links,
                  placed: Placement | None = None) -> ExpertWorker:
    """A worker rank's experts (its share of every layer's, `Placement`: `placed`, or the started processes'):
    read into RAM, or with `--worker-memory` paged from the checkpoint through a store of that many of them (one
    cache for all its layers); held again the same way when a failover changes its share."""
    opened = open_checkpoint(path, LoadOptions.of(config))
    cfg, reader = opened.config, opened.reader
    shape, kernel, cpu = reader.shape, config.expert_kernel, torch.device("cpu")
    fused = cpu_kernels.fused_experts(shape, cpu, kernel)

    def hold(owned: Sequence[tuple[int, int]]) -> tuple[ArenaKernels | None, PagedExecutor | None]:
        if config.worker_memory is not None:
            slots = Budget.parse(config.worker_memory, "--worker-memory").slots(shape.nbytes, len(owned))
            check_slots(slots, cfg.top_k, shape.nbytes, "--worker-memory", config.worker_memory)
            store_config = StoreConfig(expert_memory=str(slots * shape.nbytes + read_buffer_bytes(reader, 4)),
                                       scope="global", policy=config.store.policy, warm=False)
            return None, PagedExecutor(build_store(store_config, reader, cfg, cpu, False), shape, kernel, fused)
        arena = read_experts(reader, [ExpertKey(cfg.moe_layers[p], e) for p, e in owned], cpu)
        return ArenaKernels(arena, shape, kernel, fused=fused), None

    return ExpertWorker(rank, cfg.moe_layers, cfg.num_experts, shape, placed or placement(config, cfg), hold, links,
                        shadow_rank=SHADOW_RANK if config.shadow else None)


def build(config: EngineConfig, path: Path, show_progress: bool, links: Links = Links()) -> Built:
    """Checkpoint reader -> expert store -> executor -> model -> prefetcher, from one configuration (`links`: the
    worker ranks' process groups, with --workers)."""
    check_names(config)
    options = LoadOptions.of(config)
    opened = open_checkpoint(path, options)
    kernel, store_config = config.expert_kernel, config.store
    times, profile = expert_times(config, opened.device, opened.reader.shape.nbytes)
    execution, why = resolve_execution(config, opened.device, times, profile)
    check_split(config, opened, execution)
    if why:
        print(why, file=sys.stderr)
    store: ExpertStore | None = None
    with load_bar(opened, show_progress) as bar:
        if config.workers:
            executor: ExpertExecutor = remote_executor(config, opened.reader, opened.config, links)
            why = f"{config.workers} worker processes"
        elif execution == "hybrid":
            hybrid = _hybrid(config, opened.reader, opened.config, opened.device, times, bar.update)
            executor = hybrid
            store = hybrid.store
            why = why or f"hybrid: {times.describe()} ({profile})"
        elif execution == "cpu-experts":
            cpu_experts = cpu_experts_executor(config, opened.device)(opened.reader, opened.config, bar.update)
            assert isinstance(cpu_experts, CpuExpertsExecutor)
            executor, store = cpu_experts, cpu_experts.store
            why = why or "cpu-experts: every routed expert computes on the CPU"
        elif store_config.paged:
            paged = _paged(store_config, opened.reader, opened.paging, opened.device, kernel,
                           opened.device.type == "cuda", bar.update)
            executor = paged
            store = paged.store
        else:
            executor = resident_executor(opened.device, kernel)(opened.reader, opened.paging, bar.update)
        if opened.split is not None:
            executor = SplitExecutor(executor, opened.split.parts)
        loaded = build_model(opened, executor, options, bar.update)
    loaded.execution = why
    prefetcher = None
    if config.prefetch.predictor is not None and config.workers:  # forecasts become the workers' loads ahead
        assert isinstance(executor, RemoteExecutor)
        prefetcher = build_prefetcher(config.prefetch, loaded.model, executor)
        loaded.model.observe_routing(prefetcher)
    elif config.prefetch.predictor is not None and store is not None:
        inner = store.order.inner  # the device tier's eviction policy, which may rank by forecasts (fMoE, PLEC)
        forecasts: ForecastConsumer | None = inner if inner.uses_predictions else None
        target: StoreView = store
        if store.parts > 1:  # a split checkpoint: forecasts of whole experts load their cacheable parts
            target = WholeExperts(store)
            forecasts = PartForecasts(forecasts, store.parts) if forecasts is not None else None
        prefetcher = build_prefetcher(config.prefetch, loaded.model, target, forecasts, inner.ranks_next_use)
        loaded.model.observe_routing(prefetcher)
    return Built(loaded, store, prefetcher, online_configurator(config, opened, store, execution, profile))


def online_configurator(config: EngineConfig, opened: OpenCheckpoint, store: ExpertStore | None,
                        execution: Execution, profile: str) -> OnlineConfigurator | None:
    """`--configure auto`'s configurator over the run's store, its T values from the run's cost model (`--profile`,
    else the nominal one of the device's kind)."""
    if config.store.configure != "auto":
        return None
    if store is None or execution != "gpu" or config.workers:
        raise ConfigError("--configure auto sizes the expert store's per-layer caches: it runs with --expert-memory "
                          "and --execution gpu, without --workers")
    cfg = opened.config
    whole = opened.reader.shape.nbytes * store.parts
    try:
        cost = CostModel.profile(profile, whole)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return OnlineConfigurator(store, cfg.moe_layers, cfg.num_experts, cfg.top_k, layer_costs(cost, cfg.num_moe_layers),
                              config.store.configure_every)


def check_split(config: EngineConfig, opened: OpenCheckpoint, execution: Execution) -> None:
    """What a split checkpoint (checkpoints/split.py) runs with: resident or paged experts (a predictor's prefetch
    loading forecast experts' cacheable parts: store/parts.py), no hybrid, CPU-only or remote execution (they place
    whole experts)."""
    if opened.split is None:
        return
    refused = [name for name, on in (("--workers", config.workers), (f"--execution {execution}", execution != "gpu"))
               if on]
    if refused:
        raise ConfigError(f"{opened.checkpoint.path} stores its experts in {opened.split.parts} parts (moepager "
                          f"split), which run resident or paged through the store; {', '.join(refused)} place whole "
                          "experts: run the unsplit checkpoint for that")


def store_report(store: ExpertStore | None, config: StoreConfig, prefill_tokens: int,
                 decode_tokens: int, execution: str = "") -> StoreReport:
    """The run's expert section: how experts were held and, for the store, what it did per phase."""
    where = {"execution": execution} if execution else {}
    if store is None:
        return StoreReport({"placement": "all resident", **where}, {})
    described = {"device slots": store.device.table.capacity,
                 "stream rows": len(store.device.table.stream_rows),
                 "read buffers": format_bytes(store.read_buffer_bytes),
                 "host slots": store.host.table.capacity if store.host is not None else "none (disk below)",
                 "policy": config.policy, "scope": config.scope, **where}
    if store.parts > 1:
        described["device slots"] = f"{store.device.table.capacity} expert parts"
        described["split"] = (f"{store.parts} parts an expert, top parts cached per layer "
                              + " ".join(str(t) for t in store.cached_parts.values()))
    if config.layer_plan:
        described["per-layer cache"] = " ".join(str(q) for q in store.device.table.quota.values())
    phases, nbytes = store.counters.phases, store.device.expert_nbytes
    return StoreReport(described, {"prefill": phases["prefill"].summary(prefill_tokens, nbytes),
                                   "decode": phases["decode"].summary(decode_tokens, nbytes)})
