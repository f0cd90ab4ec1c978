"""ExpertFlow's Routing Path Predictor (He et al. 2024, "ExpertFlow", §3.2; seed digest expertflow.md §2.1).

A small transformer reads the tokens the MoE model reads and, before the model's pass runs, predicts every MoE
layer's routing for each of them: one head per MoE layer (d_model -> E), trained as a multi-label classifier
with binary cross-entropy over the L x E routing path (eq. 3), AdamW (weight decay 0.01, cosine schedule, 16
sequences a batch; lr 3e-3, not the paper's 1e-3: on traces of a few thousand requests 1e-3 leaves the model
far from converged in 20 epochs, 34.8% against 70.2% recall@4 on the built-in model's validation trace).
Shapes (`SHAPES`):
- `t5`: the paper's, T5-small with d_model 32 and d_ff 2048: 6 encoder + 6 decoder blocks, 8 heads of 64.
  The encoder reads a request's prompt with full (bidirectional) attention, as the paper's does, and its own
  heads forecast the prompt tokens' paths: a prompt is known whole before its prefill pass runs, so a prompt
  token may see the ones after it. The decoder reads the generated tokens causally, with cross-attention to
  the encoded prompt; its heads forecast each generated token's path (the seed digest's resolution A3, the
  targets unshifted). A prompt that arrives in chunks is encoded again with each chunk (what it has so far).
- `paper`: the paper's widths, decoder-only (6 causal blocks over every token, prompt and generated alike).
- `small`: decoder-only, lighter (2 blocks, d_model 64, d_ff 256).
No position encoding (causal attention orders the tokens by itself; the encoder's prompt is a bag of tokens,
ordered through the decoder's view of it only); the context is the last `window` tokens of each part.
In the engine it keeps its own state per request (the encoded prompt, the decoder's KV cache): each decode
pass adds one token per request and forecasts that token's whole path before the first MoE layer runs
(distance "pass"; `--prefetch-distance L`). Offline evaluation feeds a request's prompt and then its
generated tokens as two rows of one iteration.
Tokens are hashed into `vocab` buckets (head.token_buckets), so token ids and trace token strings both work.
Shape legend: N rows (tokens), B sequences, T positions, D d_model, H heads, C d_kv, L MoE layers, E experts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from moepager.predictors.base import Forecast, LayerObservation, PredictorError
from moepager.predictors.head import token_buckets
from moepager.types import Phase


@dataclass(frozen=True)
class PathFit:
    """What `moepager predictor fit --kind ...` takes for this predictor (trace/fit.py fits it)."""

    epochs: int = 20
    """Passes over the training requests."""
    shape: str = "small"
    """"small" (decoder-only, 2 layers), "paper" (ExpertFlow's widths, 6 causal layers) or "t5" (the paper's 6 + 6
    encoder-decoder)."""
    prompt: int | None = None
    """(t5) each request's first N tokens are its prompt, the rest generated (as a replay with `--route-prompt N`
    runs it); default: the recorded phases."""
    resume: str | None = None
    """A checkpoint written after every epoch, continued from when it exists."""
    seed: int = 0



@dataclass(frozen=True)
class PathShape:
    layers: int = 6
    d_model: int = 32
    d_ff: int = 2048
    heads: int = 8
    d_kv: int = 64
    vocab: int = 32768
    """Token hash buckets (T5's vocabulary is 32,128)."""
    window: int = 256
    """Tokens of context (the KV cache keeps at most this many per request; the encoder the prompt's last)."""
    encoder_layers: int = 0
    """The T5 layout when > 0: this many encoder blocks over the prompt, `layers` decoder blocks with
    cross-attention over the generated tokens; 0: decoder-only over every token."""


PAPER = PathShape()
T5 = PathShape(encoder_layers=6)
SMALL = PathShape(layers=2, d_model=64, d_ff=256, heads=4, d_kv=16)
SHAPES = {"t5": T5, "paper": PAPER, "small": SMALL}


class _CrossAttention(torch.nn.Module):
    """Decoder positions attend over the encoded prompt (T5's encoder-decoder attention, pre-norm)."""

    def __init__(self, s: PathShape):
        super().__init__()
        inner = s.heads * s.d_kv
        self.heads, self.d_kv = s.heads, s.d_kv
        self.norm = torch.nn.LayerNorm(s.d_model)
        self.q = torch.nn.Linear(s.d_model, inner, bias=False)
        self.kv = torch.nn.Linear(s.d_model, 2 * inner, bias=False)
        self.out = torch.nn.Linear(inner, s.d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor, memory_BPD: torch.Tensor, mask_BP: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x_BTD.shape
        q = self.q(self.norm(x_BTD)).view(b, t, self.heads, self.d_kv).transpose(1, 2)
        k, v = self.kv(memory_BPD).view(b, memory_BPD.shape[1], 2, self.heads, self.d_kv).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask_BP is None else mask_BP[:, None, None])
        return self.out(att.transpose(1, 2).reshape(b, t, -1))


class Memory(NamedTuple):
    """The encoded prompt the decoder attends to."""

    memory_BPD: torch.Tensor
    mask_BP: torch.Tensor | None
    """Which prompt positions are real (padding in training batches); None: all."""


class _Block(torch.nn.Module):
    def __init__(self, s: PathShape, cross: bool = False):
        super().__init__()
        inner = s.heads * s.d_kv
        self.heads, self.d_kv = s.heads, s.d_kv
        self.norm1, self.norm2 = torch.nn.LayerNorm(s.d_model), torch.nn.LayerNorm(s.d_model)
        self.qkv = torch.nn.Linear(s.d_model, 3 * inner, bias=False)
        self.out = torch.nn.Linear(inner, s.d_model, bias=False)
        self.ff1, self.ff2 = torch.nn.Linear(s.d_model, s.d_ff), torch.nn.Linear(s.d_ff, s.d_model)
        self.cross = _CrossAttention(s) if cross else None

    def forward(self, x_BTD: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None,
                memory: Memory | None = None, causal: bool = True, mask_BT: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Causal self-attention over `past` and the new positions (or, `causal=False`, full attention over
        the positions `mask_BT` marks real: the encoder), then cross-attention to `memory` (decoder blocks)."""
        b, t, _ = x_BTD.shape
        q, k, v = self.qkv(self.norm1(x_BTD)).view(b, t, 3, self.heads, self.d_kv).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        if causal:
            mask = torch.ones(t, k.shape[2], dtype=torch.bool).tril(k.shape[2] - t)
        else:
            mask = None if mask_BT is None else mask_BT[:, None, None]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x_BTD = x_BTD + self.out(att.transpose(1, 2).reshape(b, t, -1))
        if self.cross is not None:
            if memory is None:
                raise PredictorError("a decoder block of the T5 path predictor needs the encoded prompt")
            x_BTD = x_BTD + self.cross(x_BTD, *memory)
        x_BTD = x_BTD + self.ff2(F.gelu(self.ff1(self.norm2(x_BTD))))
        return x_BTD, (k, v)


class PathModel(torch.nn.Module):
    def __init__(self, shape: PathShape, num_layers: int, num_experts: int):
        super().__init__()
        self.shape, self.num_layers, self.num_experts = shape, num_layers, num_experts
        self.embed = torch.nn.Embedding(shape.vocab, shape.d_model)
        """Shared by the encoder and the decoder (T5 ties them)."""
        self.blocks = torch.nn.ModuleList(_Block(shape, cross=self.encoded) for _ in range(shape.layers))
        self.norm = torch.nn.LayerNorm(shape.d_model)
        self.heads = torch.nn.Linear(shape.d_model, num_layers * num_experts)
        """The L per-layer heads (d_model -> E each) as one matrix."""
        if self.encoded:
            self.encoder = torch.nn.ModuleList(_Block(shape) for _ in range(shape.encoder_layers))
            self.encoder_norm = torch.nn.LayerNorm(shape.d_model)
            self.prompt_heads = torch.nn.Linear(shape.d_model, num_layers * num_experts)
            """The prompt tokens' L heads, on the encoder's states."""

    @property
    def encoded(self) -> bool:
        return self.shape.encoder_layers > 0

    def encode(self, bucket_BP: torch.Tensor, mask_BP: torch.Tensor | None = None) -> tuple[Memory, torch.Tensor]:
        """The prompt through the encoder: the memory the decoder attends to, and the prompt's logits_BPLE."""
        x = self.embed(bucket_BP)
        for block in self.encoder:
            x, _ = block(x, None, causal=False, mask_BT=mask_BP)
        memory_BPD = self.encoder_norm(x)
        b, p, _ = x.shape
        return Memory(memory_BPD, mask_BP), self.prompt_heads(memory_BPD).view(b, p, self.num_layers, self.num_experts)

    def forward(self, bucket_BT: torch.Tensor, past: list | None = None, memory: Memory | None = None
                ) -> tuple[torch.Tensor, list]:
        """logits_BTLE for the new positions, and the blocks' (K, V) including them (`memory`: the encoded
        prompt, for the T5 layout's decoder)."""
        x = self.embed(bucket_BT)
        cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if past is None else past[i], memory)
            cache.append(kv)
        b, t, _ = x.shape
        return self.heads(self.norm(x)).view(b, t, self.num_layers, self.num_experts), cache


@dataclass
class _RequestState:
    """What the predictor keeps of one request between passes."""

    seen: int = 0
    past: list | None = None
    """The decoder blocks' (K, V), the last `window` positions."""
    prompt_T: torch.Tensor | None = None
    """T5 layout: the prompt's token buckets so far (the last `window`) and their encoding."""
    memory: Memory | None = None
    ahead: _Ahead | None = None
    """The next token, advanced over before its pass (`PathPredictor.lookahead`)."""


class _Ahead(NamedTuple):
    start: int
    bucket: int
    probs_LE: torch.Tensor
    before: _RequestState
    """The state as it was without the token (put back when the pass feeds another one)."""


class PathPredictor:
    name = "path"
    semantic = None
    needs_scores = False
    hidden = None

    def __init__(self, model: PathModel):
        self.model = model.eval()
        self.num_layers, self.num_experts = model.num_layers, model.num_experts
        self._probs_NLE: torch.Tensor | None = None
        self._rows: tuple[Sequence[int], Sequence[int], Sequence[int], Sequence[Phase]] | None = None
        self._cache: dict[int, _RequestState] = {}
        self.ahead_missed = 0
        """Lookaheads the pass did not use (it fed another token there: the state was put back)."""

    @property
    def distances(self) -> set[int]:
        return set(range(self.num_layers + 1))

    def begin_rows(self, requests: Sequence[int], starts: Sequence[int], counts: Sequence[int],
                   phases: Sequence[Phase] | None = None) -> None:
        """The coming iteration's rows: `counts[i]` tokens of request `requests[i]` from position `starts[i]`,
        prompt tokens (`phases[i]` "prefill") or generated ones (default: generated)."""
        self._rows = (requests, starts, counts, phases or ("decode",) * len(requests))

    def end_request(self, request: int) -> None:
        self._cache.pop(request, None)

    @torch.no_grad()
    def start_iteration(self, token_ids_N: torch.Tensor, sem_ND: torch.Tensor | None) -> None:
        if not len(token_ids_N):
            self._probs_NLE = None
            return
        bucket_N = token_buckets(token_ids_N.tolist(), self.model.shape.vocab)
        if self._rows is None:  # offline, no rows given: one request's tokens in order, all of them its prompt
            self._probs_NLE = torch.sigmoid(self._advance(_RequestState(), bucket_N, "prefill"))
            return
        out, offset = [], 0
        for request, start, n, phase in zip(*self._rows, strict=True):
            state, piece = self._cache.get(request), bucket_N[offset:offset + n]
            offset += n
            if state is not None and (ahead := state.ahead) is not None:
                if n == 1 and (start, int(piece[0])) == ahead[:2]:  # the token forecast ahead: its path as it was
                    state.ahead = None
                    out.append(ahead.probs_LE[None])
                    continue
                state = self._cache[request] = ahead.before  # another token came (or a prompt again)
                self.ahead_missed += 1
            if state is None or start == 0 or start != state.seen:  # new, or preempted and computed again
                state = self._cache[request] = _RequestState()
            out.append(torch.sigmoid(self._advance(state, piece, phase)))
        self._rows = None
        self._probs_NLE = torch.cat(out)

    @torch.no_grad()
    def lookahead(self, request: int, start: int, token_id: int) -> torch.Tensor | None:
        """probs_LE of a decoding request's next token (its input at position `start`, known once the last pass
        sampled it) before the pass that feeds it is scheduled: what the token scheduler groups by (ExpertFlow
        §3.3.3: paths predicted, not the last token's). The state advances over the token now and the pass's
        `start_iteration` reuses the forecast, so it costs nothing twice; when the pass feeds another token there
        (a replay reads the recorded ones) the state is put back first. None when the predictor has not followed
        the request up to `start` (new, or preempted)."""
        state = self._cache.get(request)
        if state is None or (state.ahead is None and start != state.seen):
            return None
        bucket = int(token_buckets([token_id], self.model.shape.vocab)[0])
        if state.ahead is not None:
            if state.ahead[:2] == (start, bucket):
                return state.ahead.probs_LE
            state = self._cache[request] = state.ahead.before
            self.ahead_missed += 1
            if start != state.seen:
                return None
        before = replace(state)
        probs_LE = torch.sigmoid(self._advance(state, torch.tensor([bucket]), "decode"))[0]
        state.ahead = _Ahead(start, bucket, probs_LE, before)
        return probs_LE

    def _advance(self, state: _RequestState, bucket_T: torch.Tensor, phase: Phase) -> torch.Tensor:
        """logits_TLE of one request's next tokens, window by window, each seeing what came before it."""
        window, out = self.model.shape.window, []
        for start in range(0, len(bucket_T), window):
            piece = bucket_T[start:start + window]
            if self.model.encoded and (phase == "prefill" or state.memory is None):
                prompt = piece if state.prompt_T is None else torch.cat([state.prompt_T, piece])
                state.prompt_T = prompt[-window:]
                state.memory, logits = self.model.encode(state.prompt_T[None])
                out.append(logits[0, -len(piece):])
            else:
                logits, past = self.model(piece[None], state.past, state.memory)
                state.past = [(k[:, :, -window:], v[:, :, -window:]) for k, v in past]
                out.append(logits[0])
            state.seen += len(piece)
        return torch.cat(out)

    def observe(self, layer: int, obs: LayerObservation) -> None:
        """The path is fixed before the pass runs: observations change nothing."""

    def forecast(self, layer: int, ahead: int) -> Forecast | None:
        if ahead or self._probs_NLE is None:
            return None  # the next token is not known before this pass ends
        return Forecast(self._probs_NLE[:, layer])

    def save(self, path: str | Path) -> None:
        torch.save(checkpoint(self.model), path)

    @classmethod
    def from_state(cls, state: dict) -> PathPredictor:
        return cls(model_from(state))


def checkpoint(model: PathModel, extra: dict | None = None) -> dict:
    return {"kind": "path", "shape": asdict(model.shape), "num_layers": model.num_layers,
            "num_experts": model.num_experts, "weights": model.state_dict(), **(extra or {})}


def model_from(state: dict) -> PathModel:
    model = PathModel(PathShape(**state["shape"]), state["num_layers"], state["num_experts"])
    model.load_state_dict(state["weights"])
    return model


class Sample(NamedTuple):
    """One training window; decoder-only samples leave the prompt part empty."""

    prompt_T: torch.Tensor
    prompt_ids_TLK: torch.Tensor
    generated_T: torch.Tensor
    generated_ids_TLK: torch.Tensor


def _samples(buckets: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], prompts: Sequence[int],
             shape: PathShape) -> list[Sample]:
    """Requests cut into windows of at most `window` tokens (the training samples). Decoder-only: every token is
    one causal sequence. T5: each prompt window alone, and the prompt's last window beside every window of
    the generated tokens."""
    window, out = shape.window, []
    for bucket_T, target_TLK, p in zip(buckets, targets, prompts):
        if not shape.encoder_layers:
            p = 0
        elif p == 0:  # a request without a prompt: its first token stands in for one
            p = 1
        empty_b, empty_t = bucket_T[:0], target_TLK[:0]
        starts = range(0, p, window)
        for start in starts[:-1]:
            out.append(Sample(bucket_T[start:start + window], target_TLK[start:start + window], empty_b, empty_t))
        last = (bucket_T[max(0, p - window):p], target_TLK[max(0, p - window):p])
        generated = range(p, len(bucket_T), window)
        if not generated and p:
            out.append(Sample(*last, empty_b, empty_t))
        for start in generated:
            out.append(Sample(*last, bucket_T[start:start + window], target_TLK[start:start + window]))
    return out


def fit_path(tokens: Sequence[Sequence[str | int]], ids: Sequence[torch.Tensor], num_experts: int,
             shape: PathShape = SMALL, epochs: int = 20, batch: int = 16, lr: float = 3e-3, seed: int = 0,
             resume: str | Path | None = None, progress: Callable[[int], None] | None = None,
             prompts: Sequence[int] | None = None) -> PathPredictor:
    """Train on requests (token lists and their ids_TLK; `prompts`: how many of each request's first tokens are
    its prompt, for the T5 layout, default all). With `resume`, a checkpoint file is written after every epoch
    (atomically) and training continues from it when it exists: same seed, same result."""
    if not tokens:
        raise PredictorError("the path predictor needs requests with token ids or token strings to learn from")
    num_layers = ids[0].shape[1]
    torch.manual_seed(seed)
    model = PathModel(shape, num_layers, num_experts)
    samples = _samples([token_buckets(list(t), shape.vocab) for t in tokens], ids,
                       [len(t) for t in tokens] if prompts is None else prompts, shape)
    steps_per_epoch = math.ceil(len(samples) / batch)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, epochs * steps_per_epoch))
    first = 0
    resume_path = Path(resume) if resume is not None else None
    if resume_path is not None and resume_path.exists():
        state = torch.load(resume_path, weights_only=True)
        if state.get("kind") != "path" or state.get("epochs") != epochs or state.get("seed") != seed:
            raise PredictorError(f"{resume_path} is not a checkpoint of this training (kind, epochs and seed must "
                                 f"match); delete it to start over")
        model.load_state_dict(state["weights"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        first = state["epoch"]
    model.train()
    for epoch in range(first, epochs):
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for b in order.split(batch):
            _train_step(model, [samples[i] for i in b], opt)
            sched.step()
        if resume_path is not None:
            _write_resume(resume_path, model, opt, sched, epoch + 1, epochs, seed)
        if progress is not None:
            progress(1)
    return PathPredictor(model)


def _padded(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], num_layers: int, num_experts: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences padded at the end: bucket_BT, the multi-hot targets y_BTLE, and which positions are real."""
    length = max(len(b) for b, _ in parts)
    bucket_BT = torch.zeros(len(parts), length, dtype=torch.long)
    y_BTLE = torch.zeros(len(parts), length, num_layers, num_experts)
    real_BT = torch.zeros(len(parts), length, dtype=torch.bool)
    for i, (bucket_T, ids_TLK) in enumerate(parts):
        t = len(bucket_T)
        bucket_BT[i, :t], real_BT[i, :t] = bucket_T, True
        y_BTLE[i, :t].scatter_(2, ids_TLK.long().clamp(min=0), (ids_TLK >= 0).float())
    return bucket_BT, y_BTLE, real_BT


def _train_step(model: PathModel, batch: list[Sample], opt: torch.optim.Optimizer) -> None:
    """One step over padded sequences: BCE over every (position, layer, expert) of the real positions, the
    prompt's (through the encoder, T5) and the generated tokens' alike."""
    def bce(logits: torch.Tensor, y: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        return (F.binary_cross_entropy_with_logits(logits, y, reduction="none").mean((2, 3)) * real).sum()

    L, E = model.num_layers, model.num_experts
    total, count, memory = torch.zeros(()), 0, None
    if model.encoded:
        prompt_BP, y_prompt, real_BP = _padded([(b.prompt_T, b.prompt_ids_TLK) for b in batch], L, E)
        memory, logits = model.encode(prompt_BP, real_BP)
        total, count = total + bce(logits, y_prompt, real_BP), count + int(real_BP.sum())
    generated = [(b.generated_T, b.generated_ids_TLK) for b in batch]
    if any(len(b) for b, _ in generated):
        gen_BT, y_gen, real_BT = _padded(generated, L, E)
        logits, _ = model(gen_BT, None, memory)
        total, count = total + bce(logits, y_gen, real_BT), count + int(real_BT.sum())
    loss = total / max(count, 1)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _write_resume(path: Path, model: PathModel, opt, sched, epoch: int, epochs: int, seed: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(checkpoint(model, {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "epoch": epoch,
                                  "epochs": epochs, "seed": seed}), tmp)
    tmp.replace(path)
