"""The engine stepping on its own thread, its outputs delivered to asyncio queues, one per request.

Requests from any number of HTTP clients join the running batch at the next step (continuous batching). A
request whose client goes away is aborted and frees its KV blocks at the next step. A request whose own row cannot
be sampled (non-finite logits, a sampler error) fails alone, with its error, and the rows beside it go on. An
exception inside a step fails the requests then running (each client gets the error) and the thread goes on
serving new ones, unless the
engine can no longer run any (`Unavailable`: a worker process lost with --on-worker-loss stop): then every later
request is refused with the reason, and /health says so, for a supervisor to restart the server.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from moepager.errors import Unavailable
from moepager.runtime.engine import Engine
from moepager.runtime.request import Request, RequestOutput
from moepager.runtime.sampling import SamplingParams
from moepager.server.metrics import Metrics

log = logging.getLogger("moepager.server")
Delivery = RequestOutput | BaseException


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self._queues: dict[int, asyncio.Queue[Delivery]] = {}
        self._requests: dict[int, Request] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.unavailable: str | None = None
        """Why the engine can no longer run requests (None while it can)."""

    def attach(self) -> None:
        """Deliver outputs to the running event loop (called from it, before any request)."""
        self._loop = asyncio.get_running_loop()
        self._stopping = False

    def start(self) -> None:
        """Step on a thread of its own (tests, embedding). `moepager serve` steps on the main thread instead
        (`run`): torch's OpenMP workers made by the main thread (loading the model) slow every parallel op of
        another thread several times over on a 2-core machine."""
        self.attach()
        self._thread = threading.Thread(target=self.run, name="moepager-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._thread is None or not self._thread.is_alive():  # (a step still running keeps its policy's thread)
            self.engine.close()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> tuple[Request, asyncio.Queue[Delivery]]:
        """Queue a request (InvalidRequestError when it cannot run: too long for the context or KV cache;
        Unavailable when no request can run any more)."""
        if self.unavailable is not None:
            raise Unavailable(f"this server can no longer generate: {self.unavailable}")
        request = self.engine.new_request(prompt_ids, params, stream=True)
        queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._requests[request.request_id] = request
        self.engine.add(request)
        self._wake.set()
        return request, queue

    def abort(self, request_id: int) -> None:
        """The client went away (or the request was answered): forget it, and stop it if still running."""
        if self._queues.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            self._wake.set()

    def run(self, until: Callable[[], bool] = lambda: False) -> None:
        """Step while there is work, until `stop` (or `until()` turns true)."""
        while not self._stopping and not until():
            if not self.engine.has_work():
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Unavailable as e:  # nothing can run any more: refuse from now on, with the reason
                log.error("engine step failed, and no request can run any more: %s", e)
                self.unavailable = str(e)
                self._fail_running(e)
                continue
            except Exception as e:  # a bad request must not take the server down: fail what ran, go on
                log.exception("engine step failed; failing the requests it ran")
                self._fail_running(e)
                continue
            self.metrics.step(self.engine.last_step)
            deliveries = []
            for out in outputs:
                queue = self._queues.pop(out.request_id, None) if out.finished else self._queues.get(out.request_id)
                if queue is not None:  # a request that failed alone gets its error, the others their tokens
                    deliveries.append((queue, out if out.error is None else out.error))
                request = self._requests.pop(out.request_id, None) if out.finished else None
                if request is not None:
                    self.metrics.finish(request)
            if deliveries and self._loop is not None:
                self._loop.call_soon_threadsafe(_put_all, deliveries)  # one wake-up of the event loop per step

    def _deliver(self, request_id: int, item: Delivery) -> None:
        """One item to one request (errors; a step's outputs go together through `_put_all`)."""
        queue = self._queues.get(request_id)
        if queue is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(queue.put_nowait, item)

    def shut_down(self, reason: str) -> None:
        """The server is stopping (Ctrl-C, SIGTERM): every request still running gets `reason` as its error at once
        (a stream's last events are an error and [DONE], so its client is not left waiting), later ones are refused
        with it; called from the stepping thread once it stopped stepping."""
        self.unavailable = reason
        self._fail_running(Unavailable(reason))

    def _fail_running(self, error: Exception) -> None:
        for request_id in list(self.engine.requests):
            self._deliver(request_id, error)
            self._queues.pop(request_id, None)
            self._requests.pop(request_id, None)
            self.engine.abort(request_id)


def _put_all(deliveries: list[tuple[asyncio.Queue[Delivery], Delivery]]) -> None:
    for queue, item in deliveries:
        queue.put_nowait(item)
