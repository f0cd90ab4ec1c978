"""The expert store built from a run's budgets, for every placement that pages experts: budgets -> slot counts ->
arenas -> tiers -> warm start. Checked before anything is allocated: each budget holds at least one MoE layer's top-k
experts (the most a decode step pins at once), and the arenas fit in the memory that is actually free (RAM, pinned RAM,
GPU)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from moepager.checkpoints.derived import SplitLayout
from moepager.config import Budget, StoreConfig
from moepager.errors import BudgetError, ConfigError
from moepager.experts.protocols import FlatReader
from moepager.models.config import ModelConfig
from moepager.policies import make_policy
from moepager.policies.prefetch import make_prefetch_policy
from moepager.store.budget import check_slots, format_bytes, ram_available, share_quotas
from moepager.store.keyspace import WHOLE, KeySpace, SplitParts
from moepager.store.slots import SlotTable
from moepager.store.store import ExpertStore
from moepager.store.tiers import Tier
from moepager.store.transfer import Transfers
from moepager.types import ExpertKey, Scope, host_empty

STREAM_ROWS = 2
"""Device rows, out of the budget, that experts a layer needs beyond its cache stream through (two: one loads
while the other is computed with, SMoE's ping-pong buffers)."""
RAM_HEADROOM = 0.9
"""Share of the currently available RAM that expert buffers may take (the rest is for activations, OS)."""
THETA_START = 0.5
"""`--configure auto` on a split checkpoint without a --layer-plan: each layer caches this share of its experts'
parts until the configurator's first change (MoEpic §3.4 starts its outer loop at θ = 0.5)."""


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


def key_space(plan: str | None, theta: Sequence[float], cfg: ModelConfig, split: SplitLayout | None) -> KeySpace:
    """What the store's keys name: whole experts, or a split checkpoint's parts, each MoE layer caching the θ_i of
    the `--layer-plan` (`plan`) rounded to the nearest part (at least one), all of them without one; a plan that splits
    experts needs a split checkpoint."""
    if split is None:
        if min(theta) < 1:
            raise ConfigError(f"--layer-plan {plan} splits experts (θ down to {min(theta):.2f}) and this checkpoint "
                              "stores them whole: write a split copy with `moepager split --model MODEL --parts 4 "
                              "--out DIR` and run that, or plan with --whole-experts")
        return WHOLE
    return SplitParts(split.parts, {layer: max(1, min(split.parts, round(t * split.parts)))
                                    for layer, t in zip(cfg.moe_layers, theta)})


def _check_fits(nbytes: int, device: torch.device, what: str) -> None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if nbytes > free:
            raise BudgetError(f"{what} needs {format_bytes(nbytes)} of GPU memory but {format_bytes(free)} is free; "
                              f"lower --expert-memory")
        return
    available = ram_available()[0] * RAM_HEADROOM
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
    if split is not None and config.configure == "auto" and not config.layer_plan:
        # MoEpic §3.4: the outer loop starts at θ = 0.5 and the configurator moves it from there (a budget that holds
        # θ = 1's top parts and stream rows holds θ = 0.5's: k·S/2 tops and k·S/2 streaming against k·S and 2)
        theta = [THETA_START] * cfg.num_moe_layers
    space = key_space(config.layer_plan, theta, cfg, split)
    least, most = [cfg.top_k] * cfg.num_moe_layers, [cfg.num_experts] * cfg.num_moe_layers
    if isinstance(space, SplitParts):  # each layer's top parts of a step's experts cached, its bottoms streaming
        assert split is not None
        tops = space.tops
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
    store = ExpertStore(tier, host, reader.read, transfers, buffers, getattr(reader, "read_many", None), space)
    if config.warm:  # the units the cache may hold only (a split checkpoint's top parts), each layer's quota first
        uneven = quotas is not None or isinstance(space, SplitParts)
        store.warm(warm_order(cfg.moe_layers, cfg.num_experts, store.device.table.quota if uneven else None,
                              space.cacheable, config.scope == "global"), progress)
    return store
