"""The transfer lanes: a prefetch waits for the demand loads in flight, and runs as soon as there are none; between
its chunks it gives way to demand loads again, unless promoted; abandoned before it starts, it never runs."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moepager.store.transfer import Transfers


def held_demand(transfers: Transfers) -> threading.Event:
    """A demand load in flight until the returned event is set."""
    release = threading.Event()
    transfers.submit(lambda: release.wait(timeout=10))
    return release


def test_a_prefetch_starts_only_once_no_demand_load_is_in_flight():
    transfers = Transfers(torch.device("cpu"), io_threads=2)
    release, order = threading.Event(), []

    def demand() -> None:
        release.wait(timeout=10)
        order.append("demand")

    try:
        first = transfers.submit(demand)
        ahead = transfers.submit(lambda between: order.append("prefetch"), ahead=True)
        time.sleep(0.1)
        assert order == [] and not ahead.done() and transfers.demand_in_flight() == 1
        release.set()
        ahead.result(timeout=10)
        assert first.done() and order == ["demand", "prefetch"] and transfers.demand_in_flight() == 0
        # with the link idle a prefetch runs at once
        assert transfers.submit(lambda between: 7, ahead=True).result(timeout=10) == 7
    finally:
        release.set()
        transfers.shutdown()


def test_the_prefetch_lane_reads_with_as_many_threads_as_it_is_given():
    """Three prefetches that can only finish together (a barrier of three) finish on a lane of three threads."""
    transfers = Transfers(torch.device("cpu"), io_threads=1, ahead_threads=3)
    together = threading.Barrier(3, timeout=10)
    try:
        futures = [transfers.submit(lambda between: together.wait(), ahead=True) for _ in range(3)]
        assert sorted(f.result(timeout=10) for f in futures) == [0, 1, 2]
    finally:
        transfers.shutdown()


def chunked_prefetch(transfers: Transfers, chunks: list[str], started: threading.Event, go_on: threading.Event):
    """A prefetch of two chunks: it records each, and waits for `go_on` after the first."""
    def job(between) -> None:
        chunks.append("first")
        started.set()
        go_on.wait(timeout=10)
        if between is not None:
            between()
        chunks.append("second")
    return transfers.submit(job, ahead=True)


@pytest.mark.parametrize("yields", [True, False], ids=["yields", "no-yield"])
def test_a_started_prefetch_gives_way_to_demand_between_its_chunks(yields):
    """A demand load that arrives while a prefetch reads holds the prefetch's next chunk until it is done (without
    `yields` the prefetch reads on beside it)."""
    transfers = Transfers(torch.device("cpu"), io_threads=1, yields=yields)
    chunks, started, go_on = [], threading.Event(), threading.Event()
    try:
        ahead = chunked_prefetch(transfers, chunks, started, go_on)
        assert started.wait(timeout=10)
        release = held_demand(transfers)
        go_on.set()
        if yields:
            time.sleep(0.1)
            assert chunks == ["first"] and not ahead.done()
        else:  # it reads on beside the demand load
            ahead.result(timeout=10)
            assert chunks == ["first", "second"] and transfers.demand_in_flight() == 1
        release.set()
        ahead.result(timeout=10)
        assert chunks == ["first", "second"]
    finally:
        go_on.set()
        transfers.shutdown()


def test_a_promoted_prefetch_no_longer_gives_way():
    """The demand load's layer needs the prefetch's expert: promoted, it reads on although demand is in flight, and
    a promoted prefetch that waits to start starts at once."""
    transfers = Transfers(torch.device("cpu"), io_threads=1, ahead_threads=2)
    chunks, started, go_on = [], threading.Event(), threading.Event()
    release = threading.Event()
    try:
        ahead = chunked_prefetch(transfers, chunks, started, go_on)
        assert started.wait(timeout=10)
        release = held_demand(transfers)
        go_on.set()
        time.sleep(0.05)
        assert chunks == ["first"]
        transfers.promote(ahead)
        ahead.result(timeout=10)
        assert chunks == ["first", "second"] and transfers.demand_in_flight() == 1
        queued = transfers.submit(lambda between: "ran", ahead=True)
        time.sleep(0.05)
        assert not queued.done()
        transfers.promote(queued)
        assert queued.result(timeout=10) == "ran" and transfers.demand_in_flight() == 1
    finally:
        go_on.set()
        release.set()
        transfers.shutdown()


def test_an_abandoned_prefetch_never_runs_and_one_reading_cannot_be_abandoned():
    transfers = Transfers(torch.device("cpu"), io_threads=1, ahead_threads=2)
    ran, release = [], threading.Event()
    chunks, started, go_on = [], threading.Event(), threading.Event()
    try:
        ahead = chunked_prefetch(transfers, chunks, started, go_on)
        assert started.wait(timeout=10)
        release = held_demand(transfers)
        future = transfers.submit(lambda between: ran.append(1), ahead=True)
        time.sleep(0.05)
        assert transfers.abandon(future) and future.result(timeout=10) is None
        assert not transfers.abandon(ahead)  # its bytes are landing: the store must keep its slot until it is done
        go_on.set()
        release.set()
        ahead.result(timeout=10)
        assert ran == [] and chunks == ["first", "second"]
    finally:
        go_on.set()
        release.set()
        transfers.shutdown()


def test_without_yields_a_prefetch_is_neither_promoted_nor_abandoned():
    transfers = Transfers(torch.device("cpu"), io_threads=1, yields=False)
    release = held_demand(transfers)
    try:
        future = transfers.submit(lambda between: between, ahead=True)
        read = transfers._ahead[future]
        transfers.promote(future)
        assert not transfers.abandon(future)
        time.sleep(0.05)
        assert not future.done()
        release.set()
        assert future.result(timeout=10) is None  # it ran, and was handed no `between`
        assert not read.urgent and not read.abandoned
    finally:
        release.set()
        transfers.shutdown()
