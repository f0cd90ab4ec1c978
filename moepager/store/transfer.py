"""Moving expert bytes: I/O thread pools for disk reads and a named CUDA stream for host->device copies.

Two lanes: on-demand loads go to `pool`; prefetches go to `ahead_pool` (one thread by default), so a demand
load never waits in a queue behind speculative ones, and a queued prefetch can still be cancelled. A prefetch
also starts only while no demand load is in flight: it uses the link when demand leaves it idle (the compute
of hits, dense layers, attention) instead of sharing it with loads the model is waiting for; on a disk-bound
machine a prefetch issued beside demand reads slowed them as much as it saved.

Every transfer is a `Future` whose result is the CUDA event that marks the end of its copy (None when the
copy was synchronous or there was none). Consumers wait on the host for the future (disk) and on the GPU
for the event (`stream.wait_event`); only benchmarks and tests synchronize.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def completed(value: T) -> Future[T]:
    f: Future[T] = Future()
    f.set_result(value)
    return f


class Transfers:
    def __init__(self, device: torch.device, io_threads: int, ahead_threads: int = 1):
        self.device = device
        self.pool = ThreadPoolExecutor(max(io_threads, 1), thread_name_prefix="moepager-io")
        self.ahead_pool = ThreadPoolExecutor(max(ahead_threads, 1), thread_name_prefix="moepager-prefetch")
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device, priority=-1) if cuda else None
        """The named stream demand host->device copies run on, beside the compute stream (high priority)."""
        self.ahead_stream = torch.cuda.Stream(device) if cuda else None
        """Prefetch copies' own stream: on one stream a demand copy queued behind every prefetch copy enqueued
        before it (up to the prefetcher's in-flight limit: 12 of 0.33 ms for DeepSeek-V2-Lite's experts over an
        H200's link). Two copies into one slot never overlap across the streams: a slot whose copy has not
        landed is never evicted (slots.py `_victims` takes settled slots only)."""
        self._demand = 0
        """Demand loads submitted and not finished."""
        self._idle = threading.Condition()

    def submit(self, fn: Callable[..., T], *args: object, ahead: bool = False) -> Future[T]:
        return self.submit_all(fn, (args,), ahead)[0]

    def submit_all(self, fn: Callable[..., T], calls: Sequence[tuple[object, ...]], ahead: bool = False) -> list[
            Future[T]]:
        """`fn(*args)` for each `args` of `calls`, on the prefetch lane (`ahead`) or the demand lane; one future
        each, in order (a layer's misses are submitted together)."""
        futures = []
        if ahead:
            for args in calls:
                futures.append(self.ahead_pool.submit(self._when_idle, fn, *args))
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

    def _when_idle(self, fn: Callable[..., T], *args: object) -> T:
        """Run a prefetch once no demand load is in flight (one arriving after it started shares the link)."""
        with self._idle:
            self._idle.wait_for(lambda: self._demand == 0)
        return fn(*args)

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
