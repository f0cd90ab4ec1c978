"""What the store's keys name: whole experts, or the parts of split experts (MoEpic §3.2; checkpoints/split.py).

The store pages units, each one flat buffer a slot holds, keyed `ExpertKey(layer, unit)`. Its key space says what a
unit is and which units its cache may hold; the store asks nothing else about split experts.
- `WholeExperts`: a unit is an expert; every unit may be cached.
- `SplitParts(S, tops)`: a split checkpoint stores expert e of a layer as S parts, unit e·S + j its part j (a
  `PartKey(layer, expert, part)` names it typed; `key` and `part` convert, the only place the arithmetic lives). Each
  layer caches its experts' first `tops[layer]` parts (θ = tops/S) and streams the rest, its bottoms, through the
  store's stream rows, never caching them; the rows no layer is using are MoEpic's prefetch buffer
  (store/buffer.py), which the split space gives its store. Consecutive parts of one expert lie together on disk and
  load in one read (`runs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from moepager.types import ExpertKey


class PartKey(NamedTuple):
    """Part `part` of expert `expert` of MoE layer `layer`, in a split checkpoint."""

    layer: int
    expert: int
    part: int


class KeySpace(Protocol):
    """The store's only knowledge of split experts."""

    parts: int
    """Units an expert is stored in (1: whole experts)."""
    streaming: frozenset[int]
    """Layers some of whose units the cache never holds: they always stream (a split layer's bottoms)."""
    buffered: bool
    """Whether the rows no layer is using load units ahead (MoEpic's prefetch buffer, store/buffer.py)."""
    runs_together: bool
    """Whether consecutive units may lie together on disk and load in one read (`runs`)."""

    def keys(self, layer: int, expert: int) -> list[ExpertKey]:
        """The units of `expert` of `layer`, in order."""
        ...

    def cacheable(self, key: ExpertKey) -> bool:
        """Whether the cache may hold unit `key`."""
        ...

    def never_cached(self, keys: Sequence[ExpertKey], misses: Sequence[int]) -> tuple[list[int], list[int]]:
        """`misses` (indices into `keys`, one layer's) as (those the cache may hold, those it never does)."""
        ...

    def runs(self, keys: Sequence[ExpertKey]) -> list[list[int]]:
        """Indices of `keys` in runs that load in one read, in order."""
        ...

    def with_tops(self, tops: Mapping[int, int]) -> KeySpace:
        """The same units, each layer's cache holding the first `tops[layer]` of each expert's (split experts)."""
        ...


class WholeExperts:
    """The identity: a unit is an expert, and the cache may hold any."""

    parts = 1
    streaming: frozenset[int] = frozenset()
    buffered = False
    runs_together = False

    def keys(self, layer: int, expert: int) -> list[ExpertKey]:
        return [ExpertKey(layer, expert)]

    def cacheable(self, key: ExpertKey) -> bool:
        return True

    def never_cached(self, keys: Sequence[ExpertKey], misses: Sequence[int]) -> tuple[list[int], list[int]]:
        return list(misses), []

    def runs(self, keys: Sequence[ExpertKey]) -> list[list[int]]:
        return [[i] for i in range(len(keys))]

    def with_tops(self, tops: Mapping[int, int]) -> KeySpace:
        raise ValueError("top parts per layer apply to split experts only")


WHOLE = WholeExperts()


@dataclass(frozen=True)
class SplitParts:
    """Experts stored in `parts` parts; each MoE layer's cache holds the first `tops[layer]` of each expert."""

    parts: int
    tops: Mapping[int, int]
    """Per MoE layer, the parts of each expert its cache may hold (1..parts; θ = tops / parts)."""
    streaming: frozenset[int] = field(init=False)
    buffered = True
    runs_together = True

    def __post_init__(self) -> None:
        if self.parts < 2:
            raise ValueError(f"split experts have 2 or more parts, not {self.parts}")
        if not all(1 <= t <= self.parts for t in self.tops.values()):
            raise ValueError(f"top parts per layer must lie in 1..{self.parts}, got {list(self.tops.values())}")
        object.__setattr__(self, "tops", dict(self.tops))
        object.__setattr__(self, "streaming", frozenset(la for la, t in self.tops.items() if t < self.parts))

    def with_tops(self, tops: Mapping[int, int]) -> SplitParts:
        """The same parts, cached up to new `tops` (the online configurator's change of θ)."""
        return SplitParts(self.parts, tops)

    def key(self, part: PartKey) -> ExpertKey:
        """The store's key of `part`."""
        return ExpertKey(part.layer, part.expert * self.parts + part.part)

    def part(self, key: ExpertKey) -> PartKey:
        """The part the store's `key` names."""
        expert, j = divmod(key.expert, self.parts)
        return PartKey(key.layer, expert, j)

    def keys(self, layer: int, expert: int) -> list[ExpertKey]:
        first = expert * self.parts
        return [ExpertKey(layer, first + j) for j in range(self.parts)]

    def top_keys(self, layer: int, expert: int) -> list[ExpertKey]:
        """The parts of `expert` that `layer`'s cache may hold."""
        return self.keys(layer, expert)[: self.tops[layer]]

    def bottom_keys(self, layer: int, expert: int) -> list[ExpertKey]:
        """The parts of `expert` that always stream."""
        return self.keys(layer, expert)[self.tops[layer]:]

    def cacheable(self, key: ExpertKey) -> bool:
        return key.expert % self.parts < self.tops[key.layer]

    def never_cached(self, keys: Sequence[ExpertKey], misses: Sequence[int]) -> tuple[list[int], list[int]]:
        cached: list[int] = []
        streamed: list[int] = []
        for i in misses:
            (cached if self.cacheable(keys[i]) else streamed).append(i)
        return cached, streamed

    def runs(self, keys: Sequence[ExpertKey]) -> list[list[int]]:
        """Consecutive parts of one expert, each run one contiguous read of the split checkpoint."""
        runs: list[list[int]] = []
        last: PartKey | None = None
        for i, key in enumerate(keys):
            part = self.part(key)
            if last is not None and part.layer == last.layer and part.expert == last.expert \
                    and part.part == last.part + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
            last = part
        return runs

    def whole(self, layer: int, held: set[int]) -> set[int]:
        """The experts of `layer` whose every cacheable part is among the units `held`."""
        experts = {self.part(ExpertKey(layer, unit)).expert for unit in held}
        return {e for e in experts if all(k.expert in held for k in self.top_keys(layer, e))}
