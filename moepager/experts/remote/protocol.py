"""OD-MoE's wire protocol: every message between the main rank, the workers and the shadow starts with a header of
`HEADER` int64s, `[op, field 1, field 2, ...]`, zero-padded; one dataclass per operation says what its fields are
(`Run`, `Place`, `Prefetch`, `Pass`, `Stop`), and `decode` turns a received header back into one. Each message's
tensors follow its header in the order its docstring gives.

A layer call (`Run`) carries the main rank's pass and its phase, so a worker counts its store's accesses by the pass
the main rank ran (its policy's clock) and in the phase the main rank's own store counts it in: nothing is guessed
from the data (a batched decode pass has several rows, and is a decode pass all the same).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, fields
from enum import IntEnum
from typing import ClassVar

import torch
import torch.distributed as dist

from moepager.errors import MoepagerError
from moepager.types import Phase


class Op(IntEnum):
    """What a message is; a header's first int."""

    STOP = 0
    RUN = 1
    PLACE = 2
    PREFETCH = 3
    PASS = 4


HEADER = 8
"""Ints in a header: the op and up to seven fields."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes a layer call's tensors may have, by their code in a header."""
PHASES: tuple[Phase, ...] = ("prefill", "decode")
"""A pass's phase by its code in a header."""
STATS = ("calls", "hits", "misses", "bytes_disk", "loads_ahead", "forecast", "routed", "aligned")
"""What a worker answers a stop with (`ExpertWorker.stats`). `forecast`: the routed experts some forecast for their
pass had named (a shadow's or the main rank's predictor's), of `routed`, every expert the worker computed.
`aligned`: the shadow's only, the positions of its KV cache the main rank's entries overwrote (KV alignment)."""
SHADOW_RANK = 1
"""The shadow rank's place in a --shadow run (runtime/shadow.py): rank 0 is the main rank, the workers follow it."""
WAIT_FOR_WORK = datetime.timedelta(days=365)
"""How long a worker (or the shadow) waits for the main rank's next message: as long as the main rank is there (a
server may sit idle for hours; --worker-timeout bounds the waits inside a layer call). A main rank that is gone ends
the wait at once (gloo: "Connection closed by peer")."""


@dataclass(frozen=True)
class Message:
    """A header's op and fields (every field an int in the header)."""

    op: ClassVar[Op]

    def header(self) -> torch.Tensor:
        values = [int(self.op), *astuple(self)]
        return torch.tensor(values + [0] * (HEADER - len(values)), dtype=torch.long)


@dataclass(frozen=True)
class Run(Message):
    """A layer call, main rank -> worker; then x [tokens, hidden], the routed ids and weights [tokens, top_k]. The
    worker answers with its experts' rows in the main rank's sorted order."""

    op: ClassVar[Op] = Op.RUN
    position: int
    """The MoE layer's position among the model's MoE layers."""
    tokens: int
    top_k: int
    x_code: int
    """x's dtype (`DTYPES`)."""
    weights_code: int
    """The routing weights' dtype (`DTYPES`)."""
    pass_id: int
    """The main rank's pass (a worker's clock; forecasts for a pass are matched to its calls)."""
    phase_code: int
    """The pass's phase (`PHASES`): the main rank's, whatever the row count."""

    @classmethod
    def of(cls, position: int, x: torch.Tensor, weights: torch.Tensor, pass_id: int, phase: Phase) -> Run:
        return cls(position, x.shape[0], weights.shape[1], DTYPES.index(x.dtype), DTYPES.index(weights.dtype),
                   pass_id, PHASES.index(phase))

    @property
    def x_dtype(self) -> torch.dtype:
        return DTYPES[self.x_code]

    @property
    def weights_dtype(self) -> torch.dtype:
        return DTYPES[self.weights_code]

    @property
    def phase(self) -> Phase:
        return PHASES[self.phase_code]


@dataclass(frozen=True)
class Place(Message):
    """A new placement (a worker was lost), main rank -> each worker left and the shadow; then the live ranks."""

    op: ClassVar[Op] = Op.PLACE
    workers: int
    """How many ranks follow."""
    group_size: int
    assign_code: int = 0
    """How a call's experts go to the group's workers (`config.WORKER_ASSIGNS`)."""
    prefill_code: int = 0
    """Who computes a prefill pass's calls (`config.WORKER_PREFILLS`)."""


@dataclass(frozen=True)
class Prefetch(Message):
    """Forecasts, main rank or shadow -> worker; then `count` (layer position, expert) pairs to load ahead."""

    op: ClassVar[Op] = Op.PREFETCH
    count: int
    pass_id: int
    """The pass they forecast (kept until its layer call comes)."""


@dataclass(frozen=True)
class Pass(Message):
    """A pass announced, main rank -> shadow, before the pass runs; then its rows [rows, 4] (request, start, count,
    decoding) and its token ids [tokens]; with KV alignment (`kv_tokens` > 0), then the aligned spans [kv_rows, 3]
    (request, start, count) and every layer's cache entries at those positions side by side [kv_tokens, values per
    position] in the main rank's cache dtype (`kv_code`; experts/remote/kv_align.py)."""

    op: ClassVar[Op] = Op.PASS
    rows: int
    tokens: int
    pass_id: int
    kv_rows: int = 0
    kv_tokens: int = 0
    kv_code: int = 0
    """The KV entries' dtype (`DTYPES`)."""

    @property
    def kv_dtype(self) -> torch.dtype:
        return DTYPES[self.kv_code]


@dataclass(frozen=True)
class Stop(Message):
    """The end, main rank -> worker or shadow (answered with `STATS`), or shadow -> a worker's forecast thread."""

    op: ClassVar[Op] = Op.STOP


MESSAGES: dict[Op, type[Message]] = {m.op: m for m in (Run, Place, Prefetch, Pass, Stop)}


def decode(header: torch.Tensor) -> Message:
    """The message a received header holds."""
    values = header.tolist()
    try:
        kind = MESSAGES[Op(values[0])]
    except ValueError:
        raise MoepagerError(f"a message with op {values[0]} came, which no rank sends") from None
    return kind(*values[1:1 + len(fields(kind))])


def receive(source: int, group: dist.ProcessGroup | None = None,
            timeout: datetime.timedelta = WAIT_FOR_WORK) -> Message:
    """The next header from `source`, decoded."""
    header = torch.empty(HEADER, dtype=torch.long)
    dist.irecv(header, source, group=group).wait(timeout=timeout)
    return decode(header)


def send(message: Message, tensors: Sequence[torch.Tensor], rank: int, group: dist.ProcessGroup | None = None,
         timeout: datetime.timedelta | None = None) -> None:
    """`message`'s header, then `tensors`, to `rank`; each send awaited (within `timeout` if given)."""
    for t in (message.header(), *tensors):
        if timeout is None:
            dist.send(t, rank, group=group)
        else:
            dist.isend(t, rank, group=group).wait(timeout=timeout)


def send_forecasts(owners: Callable[[int, Sequence[int]], list[int]], pairs: Sequence[tuple[int, int]], pass_id: int,
                   group_of: Callable[[int], dist.ProcessGroup | None]) -> None:
    """(layer position, expert) forecasts to the workers that would compute them were they right
    (`owners(position, experts)`, `Placement.ranks_of`: each layer's forecast experts assigned as a call of exactly
    those experts would be), to load ahead (`Prefetch`), each on its group (`Links.of` from the main rank,
    `Links.forecasts_of` from a shadow); a lost worker is skipped (the next layer call finds it). A send waits until
    the worker takes it: one that stopped answering holds the sender up for its group's timeout (`Links.open`) once,
    and fails at once after that. Each worker's pairs keep the order they came in (best first)."""
    by_layer: dict[int, set[int]] = {}
    for position, e in pairs:
        by_layer.setdefault(position, set()).add(e)
    owner = {(position, e): rank for position, experts in ((p, sorted(es)) for p, es in by_layer.items())
             for e, rank in zip(experts, owners(position, experts), strict=True)}
    by_rank: dict[int, list[tuple[int, int]]] = {}
    for position, e in dict.fromkeys(pairs):
        by_rank.setdefault(owner[(position, e)], []).append((position, e))
    for rank, mine in by_rank.items():
        try:
            send(Prefetch(len(mine), pass_id), [torch.tensor(mine)], rank, group_of(rank))
        except RuntimeError:
            pass
