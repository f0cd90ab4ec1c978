"""Small value types shared across subsystems.

Shape legend: T tokens, D hidden, F expert FFN width, E experts, K top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

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
    """Integers from the host as a tensor on `device` without a host sync: on CUDA through pinned memory,
    asynchronously (a copy from pageable memory waits for the device to finish its queue first)."""
    host = torch.tensor(values, dtype=torch.long)
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
