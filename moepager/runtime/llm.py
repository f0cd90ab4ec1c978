"""The Python API shared by the CLI and the server: `LLM(path).generate(prompts, params)`."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch

from moepager.config import EngineConfig, PrefetchConfig, StoreConfig
from moepager.errors import InvalidRequestError
from moepager.experts.executor import PagedExecutor
from moepager.models.default import default_model_path
from moepager.models.layers import NULL_OBSERVER, OWN_ROUTER, RoutingFanOut, RoutingObserver
from moepager.models.load import LoadedModel, load_model, parse_dtype, resident_executor
from moepager.outputs import check_file
from moepager.runtime.generate import (
    Detokenize,
    FinishReason,
    OnPass,
    OnPhase,
    OnText,
    SequenceState,
    generate_ids,
    ignore_pass,
    ignore_phase,
)
from moepager.runtime.kv_pool import KVCachePool
from moepager.runtime.prefetch import Prefetcher, build_prefetcher
from moepager.runtime.replay import ReplayReport, ReplaySpec, RouteReplayer, check_record_path, load_replay
from moepager.runtime.sampling import SamplingParams
from moepager.runtime.stats import RunStats
from moepager.runtime.store_setup import paged_executor, store_report
from moepager.runtime.tokenizer import Tokenizer
from moepager.trace.format import TraceHeader
from moepager.trace.recorder import TraceRecorder
from moepager.types import Phase

Prompt = str | list[int]


@dataclass(frozen=True)
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason


class LLM:
    """A loaded model plus its tokenizer. `generate` runs one static batch and records `last_stats`."""

    def __init__(self, model: str | os.PathLike[str] | None = None, *, dtype: str | None = None,
                 device: str = "cpu", threads: int | None = None, store: StoreConfig | None = None,
                 prefetch: PrefetchConfig | None = None, show_progress: bool = True,
                 config: EngineConfig | None = None):
        self.config = config or EngineConfig(model=str(model) if model else None, dtype=dtype, device=device,
                                             threads=threads, store=store or StoreConfig(),
                                             prefetch=prefetch or PrefetchConfig())
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        path = Path(self.config.model) if self.config.model else default_model_path()
        store_config, dev, kernel = self.config.store, torch.device(self.config.device), self.config.expert_kernel
        executor = paged_executor(store_config, dev, kernel) if store_config.paged else resident_executor(dev, kernel)
        self.loaded: LoadedModel = load_model(path, parse_dtype(self.config.dtype) if self.config.dtype else None,
                                              self.config.device, executor, show_progress, store_config.direct_io)
        self.tokenizer = Tokenizer(path) if (path / "tokenizer.json").exists() else None
        self.eos_token_ids = self._eos_token_ids()
        self.last_stats = RunStats()
        self.kv = KVCachePool(self.loaded.model, self.loaded.dtype, self.loaded.device)
        """The KV cache every call reuses (grown when a call needs more)."""
        self.prefetcher: Prefetcher | None = None
        """Forecasts routing and loads experts ahead (kept across calls: an online expert-map store grows)."""
        if self.config.prefetch.predictor is not None and isinstance(self.loaded.experts, PagedExecutor):
            self.prefetcher = build_prefetcher(self.config.prefetch, self.loaded.model, self.loaded.experts.store)

    def _eos_token_ids(self) -> list[int]:
        """End-of-sequence ids from config.json, generation_config.json and the tokenizer (read once)."""
        ids = list(self.loaded.config.eos_token_ids)
        generation = self.loaded.checkpoint.json("generation_config.json").get("eos_token_id")
        ids += generation if isinstance(generation, list) else [generation] if generation is not None else []
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            ids = list(prompt)
        elif self.tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer.json; pass token ids instead of text")
        elif chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(prompt)
        vocab = self.loaded.config.vocab_size
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _recorder(self, rows: int, hidden: bool) -> TraceRecorder:
        cfg, shape = self.loaded.config, self.loaded.expert_shape
        header = TraceHeader(model=str(self.loaded.checkpoint.path), moe_layers=tuple(cfg.moe_layers), num_experts=cfg.num_experts,
                             top_k=cfg.top_k, num_shared=int(cfg.shared_intermediate_size > 0),
                             expert_bytes=shape.nbytes, source="moepager generate --record-trace")
        return TraceRecorder(header, rows, hidden)

    @contextmanager
    def _wired(self, recorder: TraceRecorder | None, replayer: RouteReplayer | None) -> Iterator[Wiring]:
        """For one call: fresh store counters, the MoE blocks' routing source and observers (recorder,
        prefetcher), and the generation loop's hooks that announce phases and passes to them."""
        experts, model = self.loaded.experts, self.loaded.model
        on_phase: OnPhase = ignore_phase
        store = experts.store if isinstance(experts, PagedExecutor) else None
        if store is not None:
            store.counters.reset()
            on_phase = store.counters.set_phase
        observers: list[RoutingObserver] = [p for p in (recorder, self.prefetcher) if p is not None]
        parts = [p for p in (replayer, recorder, self.prefetcher) if p is not None]
        if self.prefetcher is not None:
            self.prefetcher.reset_requests()
        if observers:
            model.observe_routing(observers[0] if len(observers) == 1 else RoutingFanOut(observers))
        if replayer is not None:
            model.route_with(replayer)

        def on_pass(phase: Phase, rows: Sequence[int], counts: Sequence[int], token_ids_N: torch.Tensor) -> None:
            if store is not None:
                store.begin_pass()  # the one pass clock: policies, prefetcher and recorder all tick here
            for part in parts:
                part.begin_pass(phase, rows, counts, token_ids_N)
        try:
            yield Wiring(on_phase, on_pass if parts or store is not None else ignore_pass)
        finally:
            model.observe_routing(NULL_OBSERVER)
            model.route_with(OWN_ROUTER)

    def _check_context(self, ids: Sequence[list[int]], max_tokens: int) -> None:
        context = self.loaded.config.max_position_embeddings
        longest = max(len(i) for i in ids)
        if longest + max_tokens > context:
            raise InvalidRequestError(f"prompt of {longest} tokens plus max_tokens {max_tokens} exceeds the "
                                      f"model's context of {context} tokens")

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None, *,
                 chat: bool = False, on_text: OnText | None = None,
                 record_trace: str | os.PathLike[str] | None = None, record_hidden: bool = False) -> list[Completion]:
        """Complete every prompt; `record_trace` also writes their routing (trace format v1) to that file,
        with every router input too when `record_hidden`."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not prompts:
            raise InvalidRequestError("no prompts given")
        ids = [self.encode(p, chat) for p in prompts]  # type: ignore[union-attr]
        self._check_context(ids, params.max_tokens)
        check_file(record_trace, "record_trace")
        stats = RunStats(threads=torch.get_num_threads())
        recorder = self._recorder(len(ids), record_hidden) if record_trace is not None else None
        with self._wired(recorder, None) as hooks:
            seqs = generate_ids(self.loaded.model, ids, params, self.eos_token_ids, stats, self._detokenize, on_text,
                                self.loaded.device, hooks.on_phase, hooks.on_pass, self.kv)
        self._finish(stats, seqs, recorder, record_trace, [p if isinstance(p, str) else None for p in prompts])
        return _completions(seqs)

    def replay(self, spec: ReplaySpec, params: SamplingParams | None = None, *,
               record_trace: str | os.PathLike[str] | None = None, record_hidden: bool = False) -> list[Completion]:
        """Run the requests of a recorded trace with their recorded routing (runtime/replay.py), one after
        another; the store, policies and predictors carry over from request to request, and `last_stats`
        covers them all. `params` samples the generated tokens (their text does not steer routing here);
        the number of tokens follows the trace."""
        params = params or SamplingParams()
        check_record_path(spec, record_trace)
        check_file(record_trace, "record_trace")
        requests = load_replay(spec, self.loaded.config)
        for r in requests:
            self._check_context([r.prompt_ids], r.max_tokens)
        replayer = RouteReplayer(requests, self.loaded.config.moe_layers, self.loaded.device)
        recorder = self._recorder(len(requests), record_hidden) if record_trace is not None else None
        stats, seqs = RunStats(threads=torch.get_num_threads()), []
        with self._wired(recorder, replayer) as hooks:
            for row, r in enumerate(requests):
                part = RunStats()
                on_pass = partial(_as_row, hooks.on_pass, row)
                seqs += generate_ids(self.loaded.model, [r.prompt_ids], replace(params, max_tokens=r.max_tokens,
                                     ignore_eos=True, stop=()), [], part, None, None, self.loaded.device,
                                     hooks.on_phase, on_pass, self.kv)
                stats.add(part)
        self._finish(stats, seqs, recorder, record_trace, [None] * len(requests))
        stats.sections["replay"] = ReplayReport(str(spec.trace), [r.index for r in requests], spec.prompt_tokens)
        return _completions(seqs)

    def _finish(self, stats: RunStats, seqs: Sequence[SequenceState], recorder: TraceRecorder | None,
                record_trace: str | os.PathLike[str] | None, prompts: Sequence[str | None]) -> None:
        if recorder is not None:
            recorder.write(record_trace, [s.prompt_ids + s.out_ids for s in seqs], prompts,  # type: ignore[arg-type]
                           self._detokenize)
        stats.finish(self.loaded.device)
        stats.sections["experts"] = store_report(self.loaded.experts, self.config.store, stats.prompt_tokens,
                                                 stats.generated_tokens - stats.num_prompts)
        self.last_stats = stats

    @property
    def _detokenize(self) -> Detokenize | None:
        return self.tokenizer.decode if self.tokenizer is not None else None


def _completions(seqs: Sequence[SequenceState]) -> list[Completion]:
    return [Completion(s.prompt_ids, s.out_ids, s.text, s.finish_reason or "length") for s in seqs]


class Wiring(NamedTuple):
    on_phase: OnPhase
    on_pass: OnPass


def _as_row(on_pass: OnPass, row: int, phase: Phase, rows: Sequence[int], counts: Sequence[int],
            token_ids_N: torch.Tensor) -> None:
    """A one-prompt generation loop's passes, announced as row `row` of the whole replay."""
    on_pass(phase, [row], counts, token_ids_N)
