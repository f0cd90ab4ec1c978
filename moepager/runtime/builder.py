"""The composition root: one EngineConfig -> checkpoint reader -> placement (executor, store) -> model -> prefetcher
-> the run's wiring -> the engine.

Nothing below this module builds a collaborator of its own: the tiers receive their policies, the model receives a
built executor, the prefetcher receives its store view. The run's placement (moepager/placements/: resident, paged,
hybrid, cpu-experts or remote) is resolved once, `--execution auto` made concrete first from the cost model, and
built from one context; the prefetcher, the online configurator and the batch policy's path tracker are composed here
around whatever it built, and who hears of each pass and sees the routing is wired here once (runtime/wiring.py);
`start_engine` puts the engine core over it. Checked before anything loads: the policy and predictor names against
their registries.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moepager.accel.compiled import compile_decode
from moepager.config import DirectIO, EngineConfig, Execution, ExpertFormat, Kernel, StoreConfig
from moepager.errors import ConfigError
from moepager.experts.hybrid import ExpertTimes
from moepager.experts.remote.placement import Links
from moepager.loading.build import (
    ExecutorFactory,
    LoadedModel,
    LoadOptions,
    OpenCheckpoint,
    build_model,
    load_bar,
    open_checkpoint,
)
from moepager.placements import resolve
from moepager.placements.base import BuildContext, GivenExecutor, PlacementPlugin, expert_times
from moepager.placements.fit import fitted, unused_paging
from moepager.planning.configurator import layer_costs
from moepager.planning.cost import CostModel
from moepager.policies import UnknownPolicyError, policy_spec
from moepager.policies.prefetch import PREFETCH_POLICIES
from moepager.predictors import PREDICTORS
from moepager.runtime.batch_policy import needs_paths
from moepager.runtime.batch_policy.expertflow import PathTracker
from moepager.runtime.configure import OnlineConfigurator
from moepager.runtime.cuda_graphs import graphable
from moepager.runtime.engine import Engine, ignore_finish
from moepager.runtime.prefetch import Prefetcher, build_prefetcher
from moepager.runtime.request import Detokenize
from moepager.runtime.wiring import Wiring
from moepager.store.budget import format_bytes, heap_for_loading
from moepager.store.keyspace import SplitParts
from moepager.store.parts import PartForecasts, WholeExperts
from moepager.store.stats import StoreReport
from moepager.store.store import ExpertStore
from moepager.types import ReadsKV


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
    """What `build` composed: the model with its executor, and who hears of its passes and sees its routing (the
    store and prefetcher when experts are paged)."""

    loaded: LoadedModel
    config: EngineConfig
    """The configuration as built: the automatic fit's expert budget and prompt chunk in it (placements/fit.py)."""
    wiring: Wiring
    """The run's pass parts and routing observers: the placement's parts (the workers' executor, the shadow's feed),
    the store, `--configure auto`'s online configurator, the prefetcher, and the batch policy's path tracker."""


def resolve_execution(config: EngineConfig, device: torch.device, times: ExpertTimes, profile: str
                      ) -> tuple[Execution, str]:
    """`--execution auto` made concrete, and why (the others as they are)."""
    if config.placement.execution != "auto":
        return config.placement.execution, ""
    if device.type == "cpu":
        return "gpu", "auto: no GPU, every expert computes on the CPU where its slot is"
    if config.store.expert_memory is None:
        return "gpu", "auto: every routed expert is on the device"
    cpu, copied = times.cpu_s(1), times.device_s(1) + times.copy_s
    choice: Execution = "hybrid" if cpu < copied else "gpu"
    return choice, (f"auto: {choice}, a decode's missing expert takes {cpu * 1e3:.2f} ms on the CPU against "
                    f"{copied * 1e3:.2f} ms copied and computed on the device ({profile})")


def build(config: EngineConfig, path: Path, show_progress: bool, links: Links = Links(),
          costs: ExpertTimes | None = None, placement: PlacementPlugin | None = None) -> Built:
    """Checkpoint reader -> expert store -> executor -> model -> prefetcher, from one configuration (`links`: the
    worker ranks' process groups, with --workers; `costs`: what an expert costs on each side, in place of the
    profile's, for a caller that models a device of its own; `placement`: one the caller made, in place of the one
    the configuration resolves: `load_model`'s)."""
    check_names(config)
    options = LoadOptions.of(config)
    opened = open_checkpoint(path, options)
    times, profile = expert_times(config, opened.device, opened.reader.shape.nbytes)
    if costs is not None:  # the profile's name stays: the configurator reads its link and device
        times = costs
    if placement is None:
        config, fit = fitted(config, opened, times)  # no budget given: the expert cache sized to the memory it may use
        execution, why = resolve_execution(config, opened.device, times, profile)
        chosen = resolve(config, execution)
    else:  # the caller placed the experts itself: its placement, not the fit or --execution, decides their memory
        chosen, fit, why = placement, "", ""
    check_split(opened, chosen)
    if fit and config.store.expert_memory is None:  # every expert resident: said only where options go unused
        unused = unused_paging(config)
        fit = fit + unused if unused else ""
    if fit:  # the fit pages experts, or leaves options unused: said, as a run's statistics say it
        why = "; ".join(x for x in (fit, why) if x)
    if why:
        print(why, file=sys.stderr)
    with load_bar(opened, show_progress) as bar, heap_for_loading():  # the load's freed buffers leave the process
        placed = chosen.build(BuildContext(config, opened, times, profile, links, bar.update))
        store, why = placed.store, why or placed.why
        loaded = build_model(opened, placed.executor, options, bar.update)
    loaded.execution = why
    prefetcher = None
    view, forecasts, next_use = placed.prefetch_view, None, False
    if view is None and store is not None:
        inner = store.order.inner  # the device tier's eviction policy, which may rank by forecasts (fMoE, PLEC)
        forecasts = inner if inner.uses_predictions else None
        view, next_use = store, inner.ranks_next_use
        if isinstance(store.space, SplitParts):  # a split checkpoint: forecasts of whole experts load their parts
            view = WholeExperts(store)
            forecasts = PartForecasts(forecasts, store.space.parts) if forecasts is not None else None
    if config.prefetch.predictor is not None and view is not None:
        prefetcher = build_prefetcher(config.prefetch, loaded.model, view, forecasts, next_use)
    if config.compile:
        compile_decode(loaded.model, loaded.experts, loaded.expert_shape, loaded.device)
    cfg = opened.config
    paths = None
    if needs_paths(config.scheduler):
        paths = PathTracker(cfg.moe_layers, cfg.num_experts, prefetcher.predictor.forecast if prefetcher else None,
                            cfg.top_k, prefetcher.lookahead if prefetcher else None)
        if prefetcher is None:
            print(f"batch policy {config.scheduler.batch_policy}: requests are grouped by their last token's "
                  "routing (no --predictor; --predictor path with --expert-memory forecasts the next token's, as "
                  "ExpertFlow does)", file=sys.stderr)
    configurator = online_configurator(config, opened, store, chosen, profile, prefetcher)
    return Built(loaded, config, Wiring(loaded.model, store, configurator, prefetcher, paths, placed.pass_parts))


def load_model(path: str | os.PathLike[str], dtype: torch.dtype | None = None, device: str = "cpu",
               executor_factory: ExecutorFactory | None = None, show_progress: bool = True, *,
               direct_io: DirectIO = "auto", expert_dtype: str | None = None, int4_group: int | None = None,
               int4_zero_point: bool | None = None, dense_dtype: str | None = None, pack_dense: bool = True,
               expert_kernel: Kernel = "auto") -> LoadedModel:
    """A checkpoint ready to run, built by `build` from the configuration these arguments make (as the command line
    would: `dtype` is --dtype, `expert_dtype` --expert-dtype, ...), its experts in the executor `executor_factory`
    makes from the checkpoint's reader (a `GivenExecutor`), else where the configuration places them (all resident).
    The short form for tools and tests: the same root as a run, without its engine."""
    config = EngineConfig(model=str(path), dtype=str(dtype).removeprefix("torch.") if dtype else None, device=device,
                          store=StoreConfig(direct_io=direct_io),
                          experts=ExpertFormat(expert_dtype, int4_group, int4_zero_point), dense_dtype=dense_dtype,
                          pack_dense=pack_dense, expert_kernel=expert_kernel)
    given = GivenExecutor(executor_factory) if executor_factory is not None else None
    return build(config, Path(path), show_progress, placement=given).loaded


def start_engine(built: Built, eos_token_ids: Sequence[int], detokenize: Detokenize | None) -> Engine:
    """The engine core over the built model, told of each pass through the wiring (and of each finished request
    through the prefetcher, which forgets its state); the placement's parts that read the KV cache (the shadow's feed)
    bound to its pool, and its CUDA graphs captured at every width now, so no request pays a capture."""
    loaded, wiring, config = built.loaded, built.wiring, built.config
    prefetcher = wiring.prefetcher
    engine = Engine(loaded.model, loaded.dtype, loaded.device, config.scheduler, eos_token_ids, detokenize,
                    wiring.begin_pass, prefetcher.end_request if prefetcher is not None else ignore_finish,
                    config.cuda_graphs and graphable(loaded.model, loaded.experts, loaded.device), wiring.paths)
    for part in wiring.placement_parts:
        if isinstance(part, ReadsKV):  # the shadow's feed: KV alignment
            part.bind_kv(engine.pool)
    if engine.runner.graphs is not None:
        engine.runner.graphs.warm()
    return engine


def online_configurator(config: EngineConfig, opened: OpenCheckpoint, store: ExpertStore | None,
                        chosen: PlacementPlugin, profile: str, prefetcher: Prefetcher | None = None
                        ) -> OnlineConfigurator | None:
    """`--configure auto`'s configurator over the run's store, its T values from the run's cost model (`--profile`,
    else the nominal one of the device's kind) and the checkpoint's dense weights (the prefetch windows), told of
    the prefetcher's forecasts (its prediction statistics) when one prefetches."""
    if config.store.configure != "auto":
        return None
    if store is None or not chosen.configurable:
        raise ConfigError("--configure auto sizes the expert store's per-layer caches: it runs with --expert-memory "
                          "and --execution gpu, without --workers")
    cfg = opened.config
    whole = opened.reader.shape.nbytes * store.space.parts
    try:
        cost = CostModel.profile(profile, whole)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    window = opened.window_bytes()
    ranked = prefetcher.plan.per_row if prefetcher is not None else 0
    online = OnlineConfigurator(store, cfg.moe_layers, cfg.num_experts, cfg.top_k,
                                layer_costs(cost, cfg.num_moe_layers, window.per_layer, window.head),
                                config.store.configure_every, ranked=ranked)
    if prefetcher is not None and ranked:
        prefetcher.on_forecast = online.predicted
    return online


def check_split(opened: OpenCheckpoint, chosen: PlacementPlugin) -> None:
    """What a split checkpoint (checkpoints/split.py) runs with: a placement that `splits` (resident or paged, a
    predictor's prefetch loading forecast experts' cacheable parts: store/parts.py); the others place whole experts."""
    if opened.split is None:
        return
    if not chosen.splits:
        raise ConfigError(f"{opened.checkpoint.path} stores its experts in {opened.split.parts} parts (moepager "
                          f"split), which run resident or paged through the store; {chosen.option} place whole "
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
    if isinstance(store.space, SplitParts):
        described["device slots"] = f"{store.device.table.capacity} expert parts"
        described["split"] = (f"{store.space.parts} parts an expert, top parts cached per layer "
                              + " ".join(str(t) for t in store.space.tops.values()))
    if config.layer_plan:
        described["per-layer cache"] = " ".join(str(q) for q in store.device.table.quota.values())
    phases, nbytes = store.counters.phases, store.device.expert_nbytes
    return StoreReport(described, {"prefill": phases["prefill"].summary(prefill_tokens, nbytes),
                                   "decode": phases["decode"].summary(decode_tokens, nbytes)})
