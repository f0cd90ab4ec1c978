"""Small value types shared across subsystems.

Shape legend: T tokens, D hidden, F expert FFN width, E experts, K top-k.
"""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal, NamedTuple, Protocol, runtime_checkable

import torch


class ExpertKey(NamedTuple):
    """One routed expert: MoE layer index (the decoder layer's index) and expert id within it."""

    layer: int
    expert: int


class RoutingDecision(NamedTuple):
    """A router's choice for T tokens: expert ids, the weights their outputs are scaled by, and the router's
    score for every expert (softmax probabilities; DeepSeek-V3's sigmoid affinities), which traces record."""

    ids_TK: torch.Tensor
    weights_TK: torch.Tensor
    scores_TE: torch.Tensor
    ids_host_TK: torch.Tensor | None = None
    """The ids copied to the host once (`on_host`), for every reader there: on CUDA each copy is a host sync."""

    def on_host(self) -> RoutingDecision:
        """This decision with its ids on the host too (copied at the first call; free on the CPU)."""
        return self if self.ids_host_TK is not None else self._replace(ids_host_TK=to_host(self.ids_TK)[0])


def long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """Integers from the host as a tensor on `device` without a host sync (`to_device`, inline: every pass and
    paged layer makes one, and the call is counted per token: tests/runtime/test_overhead.py)."""
    host = torch.tensor(values, dtype=torch.long)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host sync: on CUDA through pinned memory, asynchronously (a copy from
    pageable memory waits for the device to finish its queue first)."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the host, waiting for the device once: on CUDA each is copied asynchronously into pinned
    memory and the stream is synchronized once after the last copy (a `.cpu()` each would wait once each); host
    tensors come back as they are."""
    device = next((t.device for t in tensors if t.is_cuda), None)
    if device is None:
        return list(tensors)
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) if t.is_cuda else t
           for t in tensors]
    torch.cuda.current_stream(device).synchronize()
    return out


def run_on_host(run: Callable[[torch.Tensor, RoutingDecision], torch.Tensor], x_ND: torch.Tensor,
                route: RoutingDecision) -> torch.Tensor:
    """`run` (a layer's experts computed on the host: `--execution cpu-experts`, worker processes) over the layer's
    input and routing copied to the host at once, its output copied back to their device; on the CPU, as they are."""
    if x_ND.device.type == "cpu":
        return run(x_ND, route)
    x_host, ids_host, weights_host = to_host(x_ND, route.ids_TK, route.weights_TK)
    return to_device(run(x_host, RoutingDecision(ids_host, weights_host, route.scores_TE, ids_host)), x_ND.device)


Between = Callable[[], None]
"""Called by an expert read between its chunks (a prefetch gives way to demand loads there: store/transfer.py)."""

Scope = Literal["layer", "global"]
"""An expert cache's sharing: a fixed share of slots per MoE layer, or every layer competing for all of them."""

Phase = Literal["prefill", "decode"]
"""Which part of generation a forward pass belongs to (statistics are kept per phase)."""


class PassInfo(NamedTuple):
    """One forward pass as the engine announces it to the store, the prefetcher and the recorder: batch row i
    carries `counts[i]` tokens of request `requests[i]` from its position `starts[i]` on (tokens row-major,
    padding left out), `token_ids_N` are those tokens. A start below what an observer has seen of a request
    means it was preempted and computes those tokens again. A pass that carries any prompt tokens is a prefill pass
    (prompt chunks and decodes may share one); `row_phases` says which each row is."""

    pass_id: int
    phase: Phase
    requests: tuple[int, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    row_phases: tuple[Phase, ...]
    token_ids_N: torch.Tensor
    blocks: tuple[Sequence[int], ...] = ()
    """Each row's request's KV cache blocks in the engine's pool, in order (empty where the pass has no pool: a trace's
    or the simulator's passes): what reads the engine's KV cache (the shadow's KV alignment) finds a position by."""


class PassPart(Protocol):
    """Anything told of each forward pass before it runs (the store, the prefetcher, the recorder, the workers)."""

    def begin_pass(self, info: PassInfo) -> None: ...


class KVCacheHolder(Protocol):
    """What holds the engine's KV cache (runtime/kv_pool.py `KVBlockPool`): one [blocks, block_size, ...] tensor per
    layer, allocated at first use and again when the pool grows (so read it at each use)."""

    block_size: int

    @property
    def cache(self) -> list[torch.Tensor]: ...


@runtime_checkable
class ReadsKV(Protocol):
    """A pass part that reads the engine's KV cache (the shadow's feed: KV alignment); given the pool once the engine
    exists."""

    def bind_kv(self, pool: KVCacheHolder) -> None: ...


class RunSection(Protocol):
    """A section of a run's statistics (runtime/stats.py `Section`): rows for the table, a dict for JSON."""

    def rows(self) -> list[tuple[str, str]]: ...

    def to_dict(self) -> dict: ...


@runtime_checkable
class Reports(Protocol):
    """A part of the engine that adds a section to each call's statistics (the token scheduler's paths, the
    shadow's KV alignment): its counts start again with each call (`reset_report`)."""

    report_name: str

    def reset_report(self) -> None: ...

    def report(self) -> RunSection | None:
        """This call's section; None: nothing to say."""
        ...


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc: ctypes.CDLL | None = None


def _advise_huge(address: int, nbytes: int) -> bool:
    global _libc
    if sys.platform != "linux":
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6", use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return _libc.madvise(address, nbytes, _MADV_HUGEPAGE) == 0
    except OSError:
        return False


def host_empty(*size: int, dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty(size, dtype=dtype)` on the CPU, backed by 2 MiB transparent huge pages where Linux offers them on
    request (THP in its usual `madvise` mode: asked for before the memory is first touched). Weights read once per
    token stream through memory faster so (on 4 KiB pages the hardware prefetcher stops at every page). Under 2 MiB,
    or where madvise is refused, a plain tensor."""
    nbytes = math.prod(size) * dtype.itemsize
    if nbytes < HUGE_PAGE or sys.platform != "linux":
        return torch.empty(size, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # a fresh mapping, untouched: faults in huge pages
    start = -raw.data_ptr() % HUGE_PAGE
    _advise_huge(raw.data_ptr() + start, nbytes)
    return raw[start: start + nbytes].view(dtype).view(size)


def rehome_on_huge_pages(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Copies of CPU tensors of 2 MiB or more on huge pages (`host_empty`), others as they are, one at a time as
    asked for (a caller that swaps each copy in before asking for the next holds one extra tensor, not a second model:
    the whole list at once holds the dense weights twice); tensors
    that are the same view of the same memory (a tied embedding and LM head) get the same copy."""
    done: dict[tuple[int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.nbytes < HUGE_PAGE or not t.is_contiguous():
            yield t
            continue
        key = (t.data_ptr(), tuple(t.shape), t.stride())
        if key not in done:
            done[key] = host_empty(*t.shape, dtype=t.dtype).copy_(t)
        yield done[key]
