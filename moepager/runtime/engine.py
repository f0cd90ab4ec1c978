"""The engine core: requests in, one step at a time, token outputs out.

`Engine.step()` = take new requests and aborts from the inbox, schedule (runtime/scheduler.py), run one
forward over the scheduled tokens of many requests (runtime/runner.py), then sample each request whose tokens
are all computed and retire the finished ones. `add_request` and `abort` may be called from any thread (the
server's event loop): they go through the inbox, and only the thread that steps touches the state.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from moepager.config import SchedulerConfig
from moepager.errors import InvalidRequestError, NumericalError
from moepager.models.layers import CausalLM
from moepager.runtime.batch_policy import RoutingPaths, batch_policy
from moepager.runtime.cuda_graphs import DecodeGraphs
from moepager.runtime.kv_pool import KVBlockPool
from moepager.runtime.request import Detokenize, FinishReason, Request, RequestOutput, TextTracker
from moepager.runtime.runner import ModelRunner, OnPass, ignore_pass
from moepager.runtime.sampling import NonFiniteLogits, RequestSampler, SamplingParams, sample_rows
from moepager.runtime.scheduler import Scheduled, Scheduler


def ignore_finish(request_id: int) -> None:
    """The `on_finish` of engines with no per-request state outside them."""


@dataclass
class StepStats:
    """What one step did (the server's metrics and `LLM.generate`'s statistics read these)."""

    duration_s: float
    prompt_tokens: int
    decode_tokens: int
    sampled: int


class Engine:
    def __init__(self, model: CausalLM, dtype: torch.dtype, device: torch.device, config: SchedulerConfig,
                 eos_ids: Sequence[int], detokenize: Detokenize | None, on_pass: OnPass = ignore_pass,
                 on_finish: Callable[[int], None] = ignore_finish, graphs: bool = False,
                 paths: RoutingPaths | None = None):
        """`graphs`: one-row decode passes replay CUDA graphs (the caller checked the model can be captured);
        `paths`: the requests' routing paths, for a batch policy that reads them (runtime/batch_policy/
        `needs_paths`; the caller feeds it passes and routing)."""
        self.model, self.config = model, config
        self.pool = KVBlockPool(model, dtype, device, config.kv_cache_tokens, config.block_size)
        self.scheduler = Scheduler(config, self.pool, batch_policy(config, paths))
        self.runner = ModelRunner(model, self.pool, device, on_pass, DecodeGraphs(model, self.pool) if graphs else None,
                                  config.batch_invariant)
        self.eos_ids, self.detokenize = frozenset(eos_ids), detokenize
        self.on_finish = on_finish
        """Told each finished request's id (the prefetcher forgets its per-request state)."""
        self.requests: dict[int, Request] = {}
        self.last_step: StepStats | None = None
        self._ids = itertools.count()
        self._inbox: queue.SimpleQueue[Request | int] = queue.SimpleQueue()

    # -- any thread ---------------------------------------------------------------------------------------------
    def new_request(self, prompt_ids: list[int], params: SamplingParams, seed_offset: int = 0,
                    stream: bool = False, grow_kv: bool = False) -> Request:
        """A request checked against the model's context and the KV cache; `add` queues it. `stream`: its
        outputs carry text as it becomes final (otherwise the text comes at the end). With `grow_kv` a request
        larger than the KV cache grows it (callers that add only while the engine is idle: LLM)."""
        context = self.model.config.max_position_embeddings
        if len(prompt_ids) + params.max_tokens > context:
            raise InvalidRequestError(f"prompt of {len(prompt_ids)} tokens plus max_tokens {params.max_tokens} "
                                      f"exceeds the model's context of {context} tokens")
        needed = len(prompt_ids) + params.max_tokens - 1
        if not grow_kv and needed > self.pool.capacity_tokens:
            raise InvalidRequestError(f"prompt of {len(prompt_ids)} tokens plus max_tokens {params.max_tokens} "
                                      f"needs {needed} KV cache positions; this server's KV cache holds "
                                      f"{self.pool.capacity_tokens} (--kv-cache-tokens)")
        return Request(next(self._ids), list(prompt_ids), params, RequestSampler(params, seed_offset),
                       TextTracker(self.detokenize, params.stop, stream), self.eos_ids)

    def add(self, request: Request) -> int:
        self._inbox.put(request)
        return request.request_id

    def abort(self, request_id: int) -> None:
        """Stop a request at the next step (a client went away); its blocks are freed."""
        self._inbox.put(request_id)

    def close(self) -> None:
        """Stop the batch policy's thread, if it has one (a later step starts it again)."""
        self.scheduler.close()

    # -- the stepping thread ------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.requests) or not self._inbox.empty()

    def step(self) -> list[RequestOutput]:
        """Schedule, run, sample, retire; the outputs of every request that changed."""
        start, self.last_step = time.perf_counter(), None
        outputs = self._take_inbox()
        rows = self.scheduler.schedule()
        if rows:
            decodes = [r.decoding for r in rows].count(True)
            done = self.runner.run(rows)
            outputs += self._sample(done)
            self.last_step = StepStats(time.perf_counter() - start, sum([r.count for r in rows]) - decodes, decodes,
                                       len(done))
        for out in outputs:
            if out.finished and out.request_id in self.requests:
                self._retire(self.requests[out.request_id], out.finish_reason)
        return outputs

    def _take_inbox(self) -> list[RequestOutput]:
        outputs = []
        while not self._inbox.empty():
            item = self._inbox.get()
            if isinstance(item, Request):
                if item.max_len > self.pool.capacity_tokens:
                    self.pool.grow(item.max_len)  # only callers that add while idle get here (LLM); see new_request
                self.requests[item.request_id] = item
                self.scheduler.add(item)
            elif item in self.requests:
                self._retire(self.requests[item], "abort")
                outputs.append(RequestOutput(item, [], "", [], "abort"))
        return outputs

    def _sample(self, done: list[tuple[Scheduled, torch.Tensor]]) -> list[RequestOutput]:
        if not done:
            return []
        now = time.perf_counter()
        requests, logits = [], []
        for row, row_logits in done:
            requests.append(row.request)
            logits.append(row_logits)
        picked = sample_rows(torch.stack(logits), requests)
        if list(map(type, picked)).count(NonFiniteLogits) == len(picked):  # the whole pass: the step fails, naming
            decoding = [r for r in requests if r.out_ids]                 # where NaN began
            raise self.runner.non_finite(len(decoding[0].out_ids) - 1 if decoding else None)
        outputs = []
        for request, sample in zip(requests, picked):
            if isinstance(sample, NonFiniteLogits):  # this row alone: it ends with its error, the others go on
                outputs.append(RequestOutput(request.request_id, [], "", [], "abort", self._row_error(request)))
            else:
                outputs.append(request.append(sample[0], sample[1], now))
        return outputs

    @staticmethod
    def _row_error(request: Request) -> NumericalError:
        when = f"at decode step {len(request.out_ids)}" if request.out_ids else "in its prefill"
        return NumericalError(f"the model produced NaN or infinite logits for this request {when} (the requests beside "
                              "it did not)")

    def _retire(self, request: Request, reason: FinishReason | None) -> None:
        request.finish_reason = request.finish_reason or reason
        request.stats.finished_s = time.perf_counter()
        self.scheduler.finish(request)
        del self.requests[request.request_id]
        self.on_finish(request.request_id)

    def drain(self) -> Iterator[list[RequestOutput]]:
        """Step until every request has finished."""
        while self.has_work():
            yield self.step()
