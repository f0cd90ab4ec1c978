"""Moving expert bytes: I/O thread pools for disk reads and a named CUDA stream for host->device copies.

Two lanes: on-demand loads go to `pool`; prefetches go to `ahead_pool` (one thread by default), so a demand
load never waits in a queue behind speculative ones, and a queued prefetch can still be cancelled. A prefetch
also starts only while no demand load is in flight: it uses the link when demand leaves it idle (the compute
of hits, dense layers, attention) instead of sharing it with loads the model is waiting for; on a disk-bound
machine a prefetch issued beside demand reads slowed them as much as it saved.

With `yields` (the default), each prefetch has an `AheadRead` the store steers through its ticket while it runs,
not only while it is queued:
- between the chunks of its read it gives way again whenever a demand load is in flight (a disk reads about as
  fast at one read at a time as at eight: a prefetch beside demand reads takes its share of the same bytes per
  second, so a read that started in a gap would otherwise slow the loads of the next layer);
- `promote`: a demand load needs this very expert (its layer routed to it), so it goes on at once, like one;
- `abandon`: its layer routed elsewhere before it read a byte, so it never reads (a prefetch that started
  waiting for the gate cannot be cancelled as a queued future can).

Every transfer is a `Future` whose result is the CUDA event that marks the end of its copy (None when the
copy was synchronous or there was none). Consumers wait on the host for the future (disk) and on the GPU
for the event (`stream.wait_event`); only benchmarks and tests synchronize.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from moepager.types import Between

T = TypeVar("T")


def completed(value: T) -> Future[T]:
    f: Future[T] = Future()
    f.set_result(value)
    return f


@dataclass(eq=False)
class AheadRead:
    """One prefetch's standing with the demand lane (its fields change under `Transfers`' lock only)."""

    urgent: bool = False
    """A demand load waits for it: it no longer gives way."""
    reading: bool = False
    """It passed the gate: its bytes are landing, so it can no longer be abandoned."""
    abandoned: bool = False
    """It will return without reading (its slot was given up while it waited at the gate)."""


class Transfers:
    def __init__(self, device: torch.device, io_threads: int, ahead_threads: int = 1, yields: bool = True):
        self.device = device
        self.yields = yields
        """Prefetches give way to demand loads between their chunks too, and can be promoted or abandoned while
        they wait (off: they only wait for a moment without demand to start, then run to the end)."""
        self.pool = ThreadPoolExecutor(max(io_threads, 1), thread_name_prefix="moepager-io")
        self.ahead_pool = ThreadPoolExecutor(max(ahead_threads, 1), thread_name_prefix="moepager-prefetch")
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device, priority=-1) if cuda else None
        """The named stream demand host->device copies run on, beside the compute stream (high priority)."""
        self.ahead_stream = torch.cuda.Stream(device) if cuda else None
        """Prefetch copies' own stream: on one stream a demand copy queued behind every prefetch copy enqueued
        before it (up to the prefetcher's in-flight limit of copies). Two copies into one slot never overlap across the
        streams: a slot whose copy has not landed is never evicted (slots.py `_victims` takes settled slots only)."""
        self._demand = 0
        """Demand loads submitted and not finished."""
        self._idle = threading.Condition()
        self._ahead: weakref.WeakKeyDictionary[Future, AheadRead] = weakref.WeakKeyDictionary()
        """Each prefetch's standing, by its ticket (`promote`, `abandon`, `abandoned`)."""

    def submit(self, fn: Callable[..., T], *args: object, ahead: bool = False) -> Future[T | None]:
        return self.submit_all(fn, (args,), ahead)[0]

    def submit_all(self, fn: Callable[..., T], calls: Sequence[tuple[object, ...]], ahead: bool = False
                   ) -> list[Future[T | None]]:
        """`fn(*args)` for each `args` of `calls`, on the prefetch lane (`ahead`) or the demand lane; one future
        each, in order (a layer's misses are submitted together). A prefetch's `fn` gets one more argument, the
        `Between` its read calls between chunks (None without `yields`); an abandoned prefetch returns None without
        running `fn`."""
        futures: list[Future[T | None]] = []
        if ahead:
            for args in calls:
                read = AheadRead()
                future = self.ahead_pool.submit(self._when_idle, read, fn, *args)
                self._ahead[future] = read
                futures.append(future)
            return futures
        with self._idle:
            self._demand += len(calls)
        for args in calls:
            future = self.pool.submit(fn, *args)
            future.add_done_callback(self._demand_done)
            futures.append(future)
        return futures

    def _demand_done(self, _: Future) -> None:
        with self._idle:
            self._demand -= 1
            if self._demand == 0:
                self._idle.notify_all()

    def _when_idle(self, read: AheadRead, fn: Callable[..., T], *args: object) -> T | None:
        """Run a prefetch once no demand load is in flight, or at once when it is urgent; not at all when it was
        abandoned while it waited."""
        with self._idle:
            self._idle.wait_for(lambda: read.abandoned or read.urgent or self._demand == 0)
            if read.abandoned:
                return None
            read.reading = True
        between: Between | None = (lambda: self._give_way(read)) if self.yields else None
        return fn(*args, between)

    def _give_way(self, read: AheadRead) -> None:
        """Between a prefetch's chunks: wait while a demand load is in flight, unless the prefetch is urgent."""
        with self._idle:
            self._idle.wait_for(lambda: read.urgent or self._demand == 0)

    def promote(self, ticket: Future) -> None:
        """A demand load needs the expert of the prefetch `ticket`: it stops giving way (with `yields`; any other
        ticket is left alone)."""
        read = self._ahead.get(ticket)
        if self.yields and read is not None:
            with self._idle:
                read.urgent = True
                self._idle.notify_all()

    def abandon(self, ticket: Future) -> bool:
        """Give up the prefetch `ticket` if it has not started reading (with `yields`): True when it never will, so
        its destination may be reused at once."""
        read = self._ahead.get(ticket)
        if not self.yields or read is None:
            return False
        with self._idle:
            if read.reading:
                return False
            read.abandoned = True
            self._idle.notify_all()
            return True

    def abandoned(self, ticket: Future) -> bool:
        """Whether `ticket` is a prefetch that was abandoned (it loaded nothing)."""
        read = self._ahead.get(ticket)
        return read is not None and read.abandoned

    def demand_in_flight(self) -> int:
        with self._idle:
            return self._demand

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: torch.cuda.Event | None, ahead: bool = False
             ) -> tuple[torch.cuda.Event | None, float]:
        """Copy `src` into `dst` once `after` (the destination slot's last use) has passed, on the prefetch stream
        when `ahead`.

        Returns the event marking the copy's end (CUDA) and the seconds spent synchronously (off CUDA).
        """
        stream = self.ahead_stream if ahead else self.copy_stream
        if stream is None:
            start = time.perf_counter()
            dst.copy_(src)
            return None, time.perf_counter() - start
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event, 0.0

    def shutdown(self) -> None:
        self.ahead_pool.shutdown(wait=True, cancel_futures=True)
        self.pool.shutdown(wait=True)
