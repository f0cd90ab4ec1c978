"""ExpertFlow's Routing Path Predictor (He et al. 2024, "ExpertFlow", §3.2; seed digest expertflow.md §2.1).

A small transformer reads the tokens the MoE model reads and, before the model's pass runs, predicts every MoE
layer's routing for each of them: one head per MoE layer (d_model -> E), trained as a multi-label classifier
with binary cross-entropy over the L x E routing path (eq. 3), AdamW (weight decay 0.01, cosine schedule, 16
sequences a batch; lr 3e-3, not the paper's 1e-3: on traces of a few thousand requests 1e-3 leaves the model
far from converged in 20 epochs, 34.8% against 70.2% recall@4 on the built-in model's validation trace).
Shape: the paper's is T5-small with d_model 32 and d_ff 2048 (6 + 6 layers, 8 heads of 64). Here the model is
decoder-only, because decode-order routing may only depend on the tokens so far (a bidirectional encoder
would read tokens the engine has not produced yet); `PAPER` keeps the paper's widths with 6 causal layers,
`SMALL` is a lighter one (2 layers, d_model 64, d_ff 256). No position encoding (causal attention orders the
tokens by itself); the context is the last `window` tokens of the request.
In the engine it keeps its own KV cache per request: each decode pass adds one token per request and
forecasts that token's whole path before the first MoE layer runs (distance "pass"; `--prefetch-distance L`).
Offline evaluation feeds a request's tokens as the rows of one iteration and runs them causally in one go.
Tokens are hashed into `vocab` buckets (head.token_buckets), so token ids and trace token strings both work.
Shape legend: N rows (tokens), B sequences, T positions, D d_model, H heads, C d_kv, L MoE layers, E experts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from moepager.predictors.base import Forecast, LayerObservation, PredictorError
from moepager.predictors.head import token_buckets


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
    """Tokens of context (the KV cache keeps at most this many per request)."""


PAPER = PathShape()
SMALL = PathShape(layers=2, d_model=64, d_ff=256, heads=4, d_kv=16)
SHAPES = {"paper": PAPER, "small": SMALL}


class _Block(torch.nn.Module):
    def __init__(self, s: PathShape):
        super().__init__()
        inner = s.heads * s.d_kv
        self.heads, self.d_kv = s.heads, s.d_kv
        self.norm1, self.norm2 = torch.nn.LayerNorm(s.d_model), torch.nn.LayerNorm(s.d_model)
        self.qkv = torch.nn.Linear(s.d_model, 3 * inner, bias=False)
        self.out = torch.nn.Linear(inner, s.d_model, bias=False)
        self.ff1, self.ff2 = torch.nn.Linear(s.d_model, s.d_ff), torch.nn.Linear(s.d_ff, s.d_model)

    def forward(self, x_BTD: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, _ = x_BTD.shape
        q, k, v = self.qkv(self.norm1(x_BTD)).view(b, t, 3, self.heads, self.d_kv).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        offset = k.shape[2] - t
        mask = torch.ones(t, k.shape[2], dtype=torch.bool).tril(offset)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x_BTD = x_BTD + self.out(att.transpose(1, 2).reshape(b, t, -1))
        x_BTD = x_BTD + self.ff2(F.gelu(self.ff1(self.norm2(x_BTD))))
        return x_BTD, (k, v)


class PathModel(torch.nn.Module):
    def __init__(self, shape: PathShape, num_layers: int, num_experts: int):
        super().__init__()
        self.shape, self.num_layers, self.num_experts = shape, num_layers, num_experts
        self.embed = torch.nn.Embedding(shape.vocab, shape.d_model)
        self.blocks = torch.nn.ModuleList(_Block(shape) for _ in range(shape.layers))
        self.norm = torch.nn.LayerNorm(shape.d_model)
        self.heads = torch.nn.Linear(shape.d_model, num_layers * num_experts)
        """The L per-layer heads (d_model -> E each) as one matrix."""

    def forward(self, bucket_BT: torch.Tensor, past: list | None = None) -> tuple[torch.Tensor, list]:
        """logits_BTLE for the new positions, and the blocks' (K, V) including them."""
        x = self.embed(bucket_BT)
        cache = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if past is None else past[i])
            cache.append(kv)
        b, t, _ = x.shape
        return self.heads(self.norm(x)).view(b, t, self.num_layers, self.num_experts), cache


class PathPredictor:
    name = "path"
    semantic = None
    needs_scores = False
    hidden = None
    stateful = True
    """It keeps each request's KV cache across passes (the engine tells it the rows' requests: `begin_rows`)."""

    def __init__(self, model: PathModel):
        self.model = model.eval()
        self.num_layers, self.num_experts = model.num_layers, model.num_experts
        self._probs_NLE: torch.Tensor | None = None
        self._rows: tuple[Sequence[int], Sequence[int], Sequence[int]] | None = None
        self._cache: dict[int, tuple[int, list]] = {}
        """request -> (tokens seen, the blocks' (K, V))."""

    @property
    def distances(self) -> set[int]:
        return set(range(self.num_layers + 1))

    def begin_rows(self, requests: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> None:
        """The coming iteration's rows: `counts[i]` tokens of request `requests[i]` from position `starts[i]`."""
        self._rows = (requests, starts, counts)

    def end_request(self, request: int) -> None:
        self._cache.pop(request, None)

    @torch.no_grad()
    def start_iteration(self, token_ids_N: torch.Tensor, sem_ND: torch.Tensor | None) -> None:
        if not len(token_ids_N):
            self._probs_NLE = None
            return
        bucket_N = token_buckets(token_ids_N.tolist(), self.model.shape.vocab)
        if self._rows is None:  # offline: the rows are one request's tokens in order
            self._probs_NLE = torch.sigmoid(self._run(bucket_N))
            return
        out, offset = [], 0
        for request, start, n in zip(*self._rows, strict=True):
            seen, past = self._cache.get(request, (0, None))
            if start == 0 or start != seen:  # new, or preempted and computed again: start over
                seen, past = 0, None
            logits, past = self._step(bucket_N[offset:offset + n], past)
            self._cache[request] = (seen + n, past)
            out.append(logits)
            offset += n
        self._rows = None
        self._probs_NLE = torch.sigmoid(torch.cat(out))

    def _run(self, bucket_N: torch.Tensor) -> torch.Tensor:
        """logits_NLE of a whole request, window by window, each window seeing the one before it."""
        window, out, past = self.model.shape.window, [], None
        for start in range(0, len(bucket_N), window):
            logits, past = self._step(bucket_N[start:start + window], past)
            out.append(logits)
        return torch.cat(out)

    def _step(self, bucket_T: torch.Tensor, past: list | None) -> tuple[torch.Tensor, list]:
        """One request's next tokens on top of its cache: logits_TLE, and the cache cut to the last `window`."""
        window = self.model.shape.window
        logits, past = self.model(bucket_T[None], past)
        return logits[0], [(k[:, :, -window:], v[:, :, -window:]) for k, v in past]

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


def _sequences(buckets: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], window: int
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Requests cut into windows of at most `window` tokens (the training samples)."""
    out = []
    for bucket_T, target_TLK in zip(buckets, targets):
        for start in range(0, len(bucket_T), window):
            out.append((bucket_T[start:start + window], target_TLK[start:start + window]))
    return out


def fit_path(tokens: Sequence[Sequence[str | int]], ids: Sequence[torch.Tensor], num_experts: int,
             shape: PathShape = SMALL, epochs: int = 20, batch: int = 16, lr: float = 3e-3, seed: int = 0,
             resume: str | Path | None = None, progress: Callable[[int], None] | None = None) -> PathPredictor:
    """Train on requests (token lists and their ids_TLK). With `resume`, a checkpoint file is written after
    every epoch (atomically) and training continues from it when it exists: same seed, same result."""
    if not tokens:
        raise PredictorError("the path predictor needs requests with token ids or token strings to learn from")
    num_layers = ids[0].shape[1]
    torch.manual_seed(seed)
    model = PathModel(shape, num_layers, num_experts)
    samples = _sequences([token_buckets(list(t), shape.vocab) for t in tokens], ids, shape.window)
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


def _train_step(model: PathModel, batch: list[tuple[torch.Tensor, torch.Tensor]], opt: torch.optim.Optimizer) -> None:
    """One step over padded sequences: BCE over every (position, layer, expert) of the real positions."""
    length = max(len(b) for b, _ in batch)
    bucket_BT = torch.zeros(len(batch), length, dtype=torch.long)
    y_BTLE = torch.zeros(len(batch), length, model.num_layers, model.num_experts)
    real_BT = torch.zeros(len(batch), length, dtype=torch.bool)
    for i, (bucket_T, ids_TLK) in enumerate(batch):
        t = len(bucket_T)
        bucket_BT[i, :t], real_BT[i, :t] = bucket_T, True
        y_BTLE[i, :t].scatter_(2, ids_TLK.long().clamp(min=0), (ids_TLK >= 0).float())
    logits, _ = model(bucket_BT)
    loss = F.binary_cross_entropy_with_logits(logits, y_BTLE, reduction="none").mean((2, 3))
    loss = (loss * real_BT).sum() / real_BT.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _write_resume(path: Path, model: PathModel, opt, sched, epoch: int, epochs: int, seed: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(checkpoint(model, {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "epoch": epoch,
                                  "epochs": epochs, "seed": seed}), tmp)
    tmp.replace(path)
