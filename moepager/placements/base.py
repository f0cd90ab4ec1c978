"""What a placement is to the composition root (runtime/builder.py): a plug-in that builds the run's expert executor
(and its store, if it pages) from one `BuildContext`, and what it built (`Placed`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from moepager.config import EngineConfig
from moepager.errors import ConfigError
from moepager.experts.executor import ExpertExecutor
from moepager.experts.hybrid import ExpertTimes
from moepager.experts.remote.placement import Links
from moepager.loading.build import ExecutorFactory, OpenCheckpoint
from moepager.planning.cost import CostModel, nominal_profile
from moepager.store.store import ExpertStore
from moepager.store.view import StoreView
from moepager.types import PassPart


@dataclass(frozen=True)
class BuildContext:
    """Everything a placement builds from: the run's configuration, the opened checkpoint, the cost model's expert
    times (and the profile they came from), the worker ranks' links, and the load bar's progress callback."""

    config: EngineConfig
    opened: OpenCheckpoint
    times: ExpertTimes
    profile: str
    links: Links
    progress: Callable[[int], None]


@dataclass
class Placed:
    """What a placement built."""

    executor: ExpertExecutor
    store: ExpertStore | None
    """The expert store the executor pages through (None: nothing paged in this process)."""
    why: str = ""
    """One line for the run's statistics saying how experts are placed ("" when there is nothing to say)."""
    prefetch_view: StoreView | None = None
    """Where a predictor's forecasts go when not to `store` (the workers: `RemoteExecutor`)."""
    pass_parts: tuple[PassPart, ...] = ()
    """What must hear of each pass before the store does (the workers' executor, the shadow's feed), in order."""


class PlacementPlugin(Protocol):
    name: ClassVar[str]
    """Its name in `PLACEMENTS` and in a run's statistics."""
    splits: ClassVar[bool]
    """Whether it runs a split checkpoint (experts stored in parts: store/parts.py); the others place whole
    experts."""
    configurable: ClassVar[bool]
    """Whether `--configure auto` (MoEpic's online configurator: runtime/configure.py) may size the per-layer caches
    of the store it builds."""
    option: ClassVar[str]
    """The command-line option that chooses it ("" where a budget or its absence does)."""

    def build(self, ctx: BuildContext) -> Placed: ...


@dataclass(frozen=True)
class GivenExecutor:
    """A placement its caller makes (`load_model`'s `executor_factory`: tools and tests that hold a store or a kernel
    of their own), in place of the one the configuration resolves; not in `PLACEMENTS`, since no flag chooses it. Its
    executor is made from the opened checkpoint's reader and pages through whatever the factory built: the root
    composes nothing around it."""

    factory: ExecutorFactory
    name: ClassVar[str] = "given"
    splits: ClassVar[bool] = True
    """A split checkpoint's parts go to the factory as experts (`OpenCheckpoint.paging`); the model computes them."""
    configurable: ClassVar[bool] = False
    option: ClassVar[str] = ""

    def build(self, ctx: BuildContext) -> Placed:
        return Placed(self.factory(ctx.opened.reader, ctx.opened.paging, ctx.progress), None)


def expert_times(config: EngineConfig, device: torch.device, expert_bytes: int) -> tuple[ExpertTimes, str]:
    """What an expert costs on the CPU, on the device and to copy over (`--profile`, else the nominal figures of
    the device's kind), and the profile's name. A CPU run given a device's profile (`--profile rtx4090-pcie4`, or
    one calibrated on a GPU machine) places experts as that device would: the CPU stands in for it, so the run
    takes a GPU run's data path (its copies, ping-pong rows and device cache) computed on the CPU. Without one, or
    with a CPU's, both sides are the CPU and no missing expert is worth a copy."""
    kind = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    name = config.placement.profile or nominal_profile(kind)
    try:
        model = CostModel.profile(name, expert_bytes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return model.expert_times(on_cpu=device.type == "cpu" and model.device_is_cpu), name
