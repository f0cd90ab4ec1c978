"""The Python API shared by the CLI and the server: `LLM(path).generate(prompts, params)`."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moepager.accel import cpu_kernels
from moepager.atomic_io import check_file
from moepager.checkpoints.default import default_model_path
from moepager.checkpoints.gguf_read import resolve_model_path
from moepager.checkpoints.safetensors import Checkpoint
from moepager.config import EngineConfig, PrefetchConfig, StoreConfig
from moepager.errors import ConfigError, InvalidRequestError
from moepager.experts.hybrid import ExpertTimes
from moepager.experts.remote.placement import Links
from moepager.loading.build import LoadedModel
from moepager.models.registry import tensor_specs
from moepager.predictors import PREDICTORS
from moepager.runtime.batch_policy.expertflow import PathTracker
from moepager.runtime.builder import build, start_engine, store_report
from moepager.runtime.configure import OnlineConfigurator
from moepager.runtime.prefetch import Prefetcher
from moepager.runtime.replay import ReplayReport, ReplaySpec, RouteReplayer, check_record_path, load_replay
from moepager.runtime.request import Detokenize, FinishReason, Request
from moepager.runtime.sampling import SamplingParams
from moepager.runtime.stats import RunStats
from moepager.runtime.tokenizer import Tokenizer
from moepager.store.store import ExpertStore
from moepager.trace.format import TraceHeader
from moepager.trace.recorder import RecordedRequest, TraceRecorder

Prompt = str | list[int]
OnText = Callable[[int, str], None]
"""Called with (prompt index, newly final text) as generation proceeds."""


@dataclass(frozen=True)
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason


def model_name(checkpoint: Checkpoint) -> str:
    """What a trace records as its model: the checkpoint's own name (config.json `_name_or_path`, as transformers
    writes it) or its directory's name; never a path on this machine."""
    named = checkpoint.config.get("_name_or_path")
    return named if isinstance(named, str) and named and not Path(named).is_absolute() else checkpoint.path.name


def valid_text(text: str, what: str) -> str:
    """`text` as it is when it is valid Unicode; a clear error for a lone UTF-16 surrogate (what JSON's "\\ud800"
    decodes to), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{what} is not valid Unicode: a lone surrogate (U+{ord(text[e.start]):04X}) at "
                                  f"character {e.start}") from None
    return text


class LLM:
    """A loaded model plus its tokenizer. `generate` runs one static batch and records `last_stats`."""

    def __init__(self, model: str | os.PathLike[str] | None = None, *, dtype: str | None = None,
                 device: str = "cpu", threads: int | None = None, store: StoreConfig | None = None,
                 prefetch: PrefetchConfig | None = None, show_progress: bool = True,
                 config: EngineConfig | None = None, links: Links = Links(), costs: ExpertTimes | None = None):
        """`links`: the worker ranks' process groups (--workers); `costs`: what an expert costs on the CPU, on the
        device and copied over, in place of the profile's (hybrid placement; a caller that models a device)."""
        self.config = config or EngineConfig(model=str(model) if model else None, dtype=dtype, device=device,
                                             threads=threads, store=store or StoreConfig(),
                                             prefetch=prefetch or PrefetchConfig())
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        path = resolve_model_path(self.config.model, tensor_specs) if self.config.model else default_model_path()
        built = build(self.config, path, show_progress, links, costs)
        self.config = built.config  # as built: a fitted run's budget and prompt chunk (the scheduler reads it)
        self.loaded: LoadedModel = built.loaded
        self.wiring = built.wiring
        """Who hears of each pass and sees the model's routing (the store, the prefetcher, the path tracker, the
        placement's parts); a call plugs its recorder and replayer in (`Wiring.for_call`)."""
        self.tokenizer = Tokenizer(path) if (path / "tokenizer.json").exists() else None
        self.eos_token_ids = self._eos_token_ids()
        self.last_stats = RunStats()
        self.engine = start_engine(built, self.eos_token_ids, self._detokenize)
        """The engine core every call (and the server) runs requests on; its KV cache is reused across calls."""
        if self.config.compile:
            self._compile_now()
        # The model's thousands of objects live as long as the engine: frozen out of the cyclic collector, whose
        # collections otherwise walk them all (gc_collect_main took 7-8% of a built-in model's decode, profiled)
        gc.collect()
        gc.freeze()

    def _compile_now(self) -> None:
        """Run the compiles of `--compile` now, not in the first request: a throwaway greedy generation whose decode
        steps compile the step (static shapes, then a dynamic KV length, then a dynamic block table width once the
        cache spans three blocks, accel/compiled.py). A prefetcher sits it out: its predictor (an online expert-map
        store, a per-request path cache) learns from requests, and this one is none (the graph does not trace it)."""
        scheduler = self.config.scheduler
        self._throwaway(1, min(2 * scheduler.block_size + 4, scheduler.kv_cache_tokens - 2))

    @property
    def store(self) -> ExpertStore | None:
        """The expert store, when experts are paged."""
        return self.wiring.store

    @property
    def prefetcher(self) -> Prefetcher | None:
        """Forecasts routing and loads experts ahead (kept across calls: an online expert-map store grows)."""
        return self.wiring.prefetcher

    @property
    def configurator(self) -> OnlineConfigurator | None:
        """`--configure auto`: per-layer cache sizes chosen again as the engine runs."""
        return self.wiring.configurator

    @property
    def paths(self) -> PathTracker | None:
        """Each running request's routing path (for a batch policy that groups requests by them)."""
        return self.wiring.paths

    def close(self) -> None:
        """Stop the engine's threads of its own (the batch policy's; a later call starts them again), and hand the
        frozen objects back to the cyclic collector: the engine refers back to this object (its callbacks), and a
        cycle gc.freeze() holds is never collected, so without this a dropped engine kept its whole model in memory
        (each further LLM in one process added a whole model's weights)."""
        self.engine.close()
        gc.unfreeze()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def warm_batched_decode(self) -> None:
        """Compile `--compile`'s graph for batched decode passes now, not in the first one (accel/compiled.py):
        throwaway generations of 2 rows (the attention mask's length becomes a symbol), then of 3 (the row count
        does). Nothing to do where decode passes do not compile batched, or the scheduler runs one row at a time."""
        model, scheduler = self.loaded.model, self.config.scheduler
        if model.compiled_decode is None or not model.compiled_rows or scheduler.max_num_seqs < 2:
            return
        self._throwaway(2, 4)
        if scheduler.max_num_seqs > 2:
            self._throwaway(3, 2)

    def _throwaway(self, rows: int, steps: int) -> None:
        """A greedy generation of `rows` two-token prompts for `steps` tokens that only compiles; a prefetcher sits
        it out (see `_compile_now`) and the run's statistics are dropped."""
        with self.wiring.without_prefetcher():
            self.generate([[0, 0]] * rows, SamplingParams(max_tokens=steps, ignore_eos=True))
        self.last_stats = RunStats()

    def check_runs_prompts(self) -> None:
        """A clear error where the prefetch predictor only forecasts a routing replay (replay-oracle)."""
        name = self.config.prefetch.predictor
        if self.prefetcher is not None and name is not None and PREDICTORS[name].replay_only:
            raise ConfigError(f"--predictor {name} forecasts the routing a replay runs (generate --route-from TRACE); "
                              "prompts have no recorded routing to read: choose another predictor")

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
            return self.encode_chat([{"role": "user", "content": prompt}])
        else:
            ids = self.tokenizer.encode(valid_text(prompt, "prompt"))
        return self._checked(ids)

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """A conversation through the tokenizer's chat template, ending with the assistant's turn to answer."""
        if self.tokenizer is None:
            raise InvalidRequestError("this checkpoint has no tokenizer.json; chat needs one")
        for i, message in enumerate(messages):
            valid_text(message["content"], f"messages[{i}].content")
        text = self.tokenizer.apply_chat_template(messages)
        return self._checked(self.tokenizer.encode(text, add_special_tokens=False))

    def _checked(self, ids: list[int]) -> list[int]:
        vocab = self.loaded.config.vocab_size
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _recorder(self, hidden: bool) -> TraceRecorder:
        cfg, shape = self.loaded.config, self.loaded.expert_shape
        header = TraceHeader(model=model_name(self.loaded.checkpoint), moe_layers=tuple(cfg.moe_layers),
                             num_experts=cfg.num_experts,
                             top_k=cfg.top_k, num_shared=int(cfg.shared_intermediate_size > 0),
                             expert_bytes=shape.nbytes, source="moepager generate --record-trace")
        return TraceRecorder(header, hidden)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None, *,
                 chat: bool = False, on_text: OnText | None = None,
                 record_trace: str | os.PathLike[str] | None = None, record_hidden: bool = False) -> list[Completion]:
        """Complete every prompt (request i samples with seed + i); `record_trace` also writes their routing
        (trace format v1) to that file, with every router input too when `record_hidden`."""
        self.check_runs_prompts()
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not prompts:
            raise InvalidRequestError("no prompts given")
        ids = [self.encode(p, chat) for p in prompts]  # type: ignore[union-attr]
        requests = [self.engine.new_request(i, params, k, stream=on_text is not None, grow_kv=True)
                    for k, i in enumerate(ids)]
        check_file(record_trace, "record_trace", replace=True)
        recorder = self._recorder(record_hidden) if record_trace is not None else None
        with self.wiring.for_call(recorder, None):
            stats = self._run(requests, on_text)
        self._finish(stats, requests, recorder, record_trace, [p if isinstance(p, str) else None for p in prompts])
        return [_completion(r) for r in requests]

    def replay(self, spec: ReplaySpec, params: SamplingParams | None = None, *,
               record_trace: str | os.PathLike[str] | None = None, record_hidden: bool = False,
               concurrency: int = 1) -> list[Completion]:
        """Run the requests of a recorded trace with their recorded routing (runtime/replay.py), one after
        another (or `concurrency` at a time, continuously batched: the next joins as one finishes); the store,
        policies and predictors carry over from request to request, and `last_stats` covers them all. `params`
        samples the generated tokens (their text does not steer routing here); the number of tokens follows
        the trace."""
        if concurrency < 1:
            raise InvalidRequestError(f"concurrency must be >= 1, got {concurrency}")
        params = params or SamplingParams()
        check_record_path(spec, record_trace)
        check_file(record_trace, "record_trace", replace=True)
        recorded = load_replay(spec, self.loaded.config)
        requests = [self.engine.new_request(r.prompt_ids, replace(params, max_tokens=r.max_tokens, ignore_eos=True,
                                                                  stop=()), k, grow_kv=True)
                    for k, r in enumerate(recorded)]
        replayer = RouteReplayer({q.request_id: r for q, r in zip(requests, recorded)}, self.loaded.config.moe_layers,
                                 self.loaded.device)
        recorder = self._recorder(record_hidden) if record_trace is not None else None
        stats = RunStats(threads=torch.get_num_threads())
        with self.wiring.for_call(recorder, replayer):
            if concurrency == 1:
                for request in requests:
                    stats.add(self._run([request], None))
            else:
                stats = self._run(requests, None, concurrency)
        self._finish(stats, requests, recorder, record_trace, [None] * len(requests))
        stats.sections["replay"] = ReplayReport(str(spec.trace), [r.index for r in recorded], spec.prompt_tokens)
        return [_completion(r) for r in requests]

    def _run(self, requests: Sequence[Request], on_text: OnText | None, concurrency: int | None = None) -> RunStats:
        """Run the requests on the idle engine, at most `concurrency` at a time (None: all at once; the next
        joins as one finishes), and step until they finish. Steps that compute prompt tokens count as prefill,
        the others as decode steps (TPOT); TTFT is the mean over requests from joining to the first token."""
        assert not self.engine.has_work(), "LLM.generate runs on an idle engine (not beside a server)"
        stats = RunStats(threads=torch.get_num_threads())
        graphs = self.engine.runner.graphs
        replays = graphs.replays if graphs is not None else 0
        index = {r.request_id: k for k, r in enumerate(requests)}
        pending = list(reversed(requests))
        for _ in range(len(requests) if concurrency is None else concurrency):
            if pending:
                self._join(pending.pop())
        for outputs in self.engine.drain():
            step = self.engine.last_step
            if step is not None and step.prompt_tokens:
                stats.prefill_s += step.duration_s
            elif step is not None:
                stats.tpot_s.append(step.duration_s)
            for out in outputs:
                if out.error is not None:  # one request's failure: a run of its own ends with it
                    raise out.error
                if on_text is not None and out.new_text:
                    on_text(index[out.request_id], out.new_text)
                if out.finished and pending:
                    self._join(pending.pop())
        stats.ttft_s = sum(r.stats.ttft_s or 0.0 for r in requests) / len(requests)
        stats.decode_s = sum(stats.tpot_s)
        stats.num_prompts, stats.prompt_tokens = len(requests), sum(len(r.prompt_ids) for r in requests)
        stats.generated_tokens = sum(len(r.out_ids) for r in requests)
        stats.graph_replays = graphs.replays - replays if graphs is not None else None
        return stats

    def _join(self, request: Request) -> None:
        request.stats.arrival_s = time.perf_counter()
        self.engine.add(request)

    def _finish(self, stats: RunStats, requests: Sequence[Request], recorder: TraceRecorder | None,
                record_trace: str | os.PathLike[str] | None, prompts: Sequence[str | None]) -> None:
        if recorder is not None:
            recorder.write(record_trace, [RecordedRequest(r.request_id, r.prompt_ids, r.out_ids, p)  # type: ignore[arg-type]
                                          for r, p in zip(requests, prompts)], self._detokenize)
        stats.finish(self.loaded.device)
        stats.experts = self.loaded.expert_format or self.loaded.expert_shape.format_name
        stats.dense = self.loaded.dense_format
        stats.cpu_kernels = cpu_kernels.chosen_tier() or ""
        stats.sections["experts"] = store_report(self.store, self.config.store, stats.prompt_tokens,
                                                 stats.generated_tokens - stats.num_prompts, self.loaded.execution)
        if self.prefetcher is not None:  # what the prefetcher cost the forward thread
            self.prefetcher.cost.decode_s = stats.decode_s
            stats.sections["prefetch"] = self.prefetcher.cost
        for part in self.wiring.reporting:
            if (section := part.report()) is not None:
                stats.sections[part.report_name] = section
        self.last_stats = stats

    @property
    def _detokenize(self) -> Detokenize | None:
        return self.tokenizer.decode if self.tokenizer is not None else None


def _completion(r: Request) -> Completion:
    return Completion(r.prompt_ids, r.out_ids, r.text.text, r.finish_reason or "length")
