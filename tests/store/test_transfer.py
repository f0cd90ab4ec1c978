"""The transfer lanes: a prefetch waits for the demand loads in flight, and runs as soon as there are none."""

from __future__ import annotations

import threading
import time

import torch

from moepager.store.transfer import Transfers


def test_a_prefetch_starts_only_once_no_demand_load_is_in_flight():
    transfers = Transfers(torch.device("cpu"), io_threads=2)
    release, order = threading.Event(), []

    def demand() -> None:
        release.wait(timeout=10)
        order.append("demand")

    try:
        first = transfers.submit(demand)
        ahead = transfers.submit(lambda: order.append("prefetch"), ahead=True)
        time.sleep(0.1)
        assert order == [] and not ahead.done() and transfers.demand_in_flight() == 1
        release.set()
        ahead.result(timeout=10)
        assert first.done() and order == ["demand", "prefetch"] and transfers.demand_in_flight() == 0
        # with the link idle a prefetch runs at once
        assert transfers.submit(lambda: 7, ahead=True).result(timeout=10) == 7
    finally:
        release.set()
        transfers.shutdown()


def test_the_prefetch_lane_reads_with_as_many_threads_as_it_is_given():
    """Three prefetches that can only finish together (a barrier of three) finish on a lane of three threads."""
    transfers = Transfers(torch.device("cpu"), io_threads=1, ahead_threads=3)
    together = threading.Barrier(3, timeout=10)
    try:
        futures = [transfers.submit(together.wait, ahead=True) for _ in range(3)]
        assert sorted(f.result(timeout=10) for f in futures) == [0, 1, 2]
    finally:
        transfers.shutdown()
