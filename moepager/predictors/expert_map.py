"""fMoE's expert maps (Yu et al. 2025, "fMoE: Fine-Grained Expert Offloading for Large MoE Serving", §4).

An expert map is one iteration's full gate distribution at every MoE layer (L x E), stored with a semantic
embedding of the request. Matching (per row):
- semantic search (eq. 4): cosine between the row's semantic embedding and every stored one; used before any
  layer of the iteration has been observed, and for next-iteration targets;
- trajectory search (eq. 5): cosine between the distributions observed so far (layers 0..i, concatenated)
  and the same prefix of every stored map; used for later layers of the iteration.
The matched map's distribution at the target layer is the forecast, its similarity the confidence that sets
the prefetch mass delta = clip(1 - similarity, 0, 1) (Forecast.select). The store holds at most C maps
(default 1,000); when full, a new map overwrites the stored one most redundant with it,
RDY = (d/L) * semantic similarity + ((L-d)/L) * whole-map similarity (§4.5).
Trajectory scores are kept incrementally: after layer i, score[n, c] = dot(prefix_n, prefix_c) / norms, with
the dot products accumulated layer by layer, so a search costs one [N, E] x [E, C] product per layer.
Semantic embeddings (`sem_kind`): "embedding" pools the model's embedding layer over the request's tokens so
far (the paper's choice; the engine's online stores); "hashed-tokens" is the stand-in for traces without a
model: a feature-hashed bag of the request's token ids (or strings) so far. A store fitted on a trace keeps
its kind, and the engine computes the same kind when it uses that store.
Neighbours (`neighbours` m > 1, not in the paper): the forecast averages the target layer of the m best-matching
maps, weighted by their similarity, instead of taking the single best. On top-1 (or K-hot) traces without gate
scores a stored map is one-hot per layer, so one matched map names exactly K experts for the target and ranks
the rest arbitrarily (recall@2K = recall@K), and a trajectory's cosine with thousands of one-hot prefixes ties
between many maps; the single best map then collapses to a near-random pick. Averaging the m best turns the
matches into a ranking. Semantic kind "none" is the trajectory-only mode for traces without tokens: before
any layer of the iteration is observed it forecasts the store's mean map (the layer's frequencies).
Shape legend: N rows, C stored maps, L MoE layers, E experts, D embedding width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from moepager.predictors.base import Forecast, LayerObservation, PredictorError, stable_hash

DEFAULT_CAPACITY = 1000
HASH_DIM = 256
SemKind = Literal["embedding", "hashed-tokens", "none"]


def hashed_tokens(tokens: Sequence[str | int], dim: int = HASH_DIM) -> torch.Tensor:
    """Per token, a signed one-hot vector at hash(token) (feature hashing), tokens_TD."""
    out = torch.zeros(len(tokens), dim)
    for t, tok in enumerate(tokens):
        h = stable_hash(tok)
        out[t, h % dim] = 1.0 if (h >> 32) & 1 else -1.0
    return out


def prefix_means(vectors_TD: torch.Tensor) -> torch.Tensor:
    """Row t: the mean of rows 0..t (a request's semantic embedding after its t-th token)."""
    counts = torch.arange(1, len(vectors_TD) + 1, dtype=torch.float32)[:, None]
    return torch.cumsum(vectors_TD.float(), dim=0) / counts


@dataclass(frozen=True)
class ExpertMapFit:
    """What `moepager predictor fit --kind ...` takes for this predictor (trace/fit.py fits it)."""

    capacity: int = DEFAULT_CAPACITY
    """Maps kept."""
    distance: int = 3
    """The prefetch distance its redundancy weights are for."""
    max_iterations: int = 20_000
    """Iterations sampled from the trace."""
    neighbours: int = 1
    """Best-matching maps averaged per forecast (1: fMoE's single best map)."""
    trajectory_only: bool = False
    """Match by routing trajectory only (no semantic embedding; traces without tokens)."""
    seed: int = 0



class MapNorms(NamedTuple):
    """What every match reads of the stored maps (`ExpertMapStore.derived`)."""

    norm2_LC: torch.Tensor
    """Each stored map's squared norm per layer."""
    sem_unit_CD: torch.Tensor
    """The stored semantic embeddings, normalised."""


class ExpertMapStore:
    """Up to `capacity` (semantic embedding, expert map) pairs, deduplicated by redundancy."""

    def __init__(self, num_layers: int, num_experts: int, sem_kind: SemKind, capacity: int = DEFAULT_CAPACITY,
                 distance: int = 3, neighbours: int = 1):
        if capacity < 1:
            raise PredictorError(f"expert map store capacity must be at least 1, got {capacity}")
        if neighbours < 1:
            raise PredictorError(f"expert maps need at least 1 neighbour, got {neighbours}")
        self.capacity, self.distance, self.sem_kind, self.neighbours = capacity, distance, sem_kind, neighbours
        self.maps_CLE = torch.zeros(0, num_layers, num_experts)
        self.sem_CD = torch.zeros(0, 0)
        self._derived: MapNorms | None = None
        """Made once per change of the store (a search runs at every layer of every pass; recomputing these there
        was most of fMoE's inline cost)."""

    def derived(self) -> MapNorms:
        """Each stored map's squared norm per layer, and the stored embeddings normalised."""
        if self._derived is None:
            maps = self.maps_CLE
            self._derived = MapNorms((maps * maps).sum(2).T.contiguous(), F.normalize(self.sem_CD, dim=1))
        return self._derived

    @property
    def num_layers(self) -> int:
        return self.maps_CLE.shape[1]

    @property
    def num_experts(self) -> int:
        return self.maps_CLE.shape[2]

    def add(self, sem_ND: torch.Tensor, maps_NLE: torch.Tensor) -> None:
        """Insert new iterations' maps; once full each overwrites its most redundant stored map."""
        if len(self.maps_CLE) == 0:
            self.sem_CD = torch.zeros(0, sem_ND.shape[1])
        self._derived = None
        for sem_D, map_LE in zip(sem_ND.float(), maps_NLE.float()):
            if len(self.maps_CLE) < self.capacity:
                self.maps_CLE = torch.cat([self.maps_CLE, map_LE[None]])
                self.sem_CD = torch.cat([self.sem_CD, sem_D[None]])
                continue
            num_layers = self.num_layers
            d = min(self.distance, num_layers)
            sem_sim = F.cosine_similarity(self.sem_CD, sem_D[None], dim=1)
            map_sim = F.cosine_similarity(self.maps_CLE.flatten(1), map_LE.flatten()[None], dim=1)
            rdy = (d / num_layers) * sem_sim + ((num_layers - d) / num_layers) * map_sim
            y = int(torch.argmax(rdy))
            self.maps_CLE[y], self.sem_CD[y] = map_LE, sem_D

    def save(self, path: str | Path) -> None:
        torch.save({"kind": "expert-map", "maps": self.maps_CLE, "sem": self.sem_CD, "capacity": self.capacity,
                    "distance": self.distance, "sem_kind": self.sem_kind, "neighbours": self.neighbours}, path)

    @classmethod
    def from_state(cls, state: dict) -> ExpertMapStore:
        maps, sem = state["maps"], state["sem"]
        store = cls(maps.shape[1], maps.shape[2], state["sem_kind"], state["capacity"], state["distance"],
                    state.get("neighbours", 1))
        store.maps_CLE, store.sem_CD = maps.float(), sem.float()
        store._derived = None
        return store


class ExpertMapPredictor:
    name = "expert-map"

    def save(self, path: str | Path) -> None:
        """The map store (what `moepager predictor fit --kind expert-map` writes)."""
        self.store.save(path)

    needs_scores = True
    hidden = None

    @property
    def semantic(self) -> SemKind | None:
        return None if self.store.sem_kind == "none" else self.store.sem_kind

    def __init__(self, store: ExpertMapStore, learn: bool = False):
        self.store = store
        self.learn = learn
        """Insert every finished iteration's map into the store (fMoE's online mode)."""
        self._sem_ND: torch.Tensor | None = None
        self._dots_NC: torch.Tensor | None = None
        self._norm2_NC: torch.Tensor | None = None
        self._own2_N: torch.Tensor | None = None
        self._observed: list[torch.Tensor] = []
        self._tokens = 0

    def start_iteration(self, token_ids_N: torch.Tensor, sem_ND: torch.Tensor | None) -> None:
        self._finish_iteration()
        self._sem_ND = None if sem_ND is None else sem_ND.float()
        self._tokens = len(token_ids_N)
        self._dots_NC = self._norm2_NC = self._own2_N = None
        self._observed = []

    def observe(self, layer: int, obs: LayerObservation) -> None:
        p_NE = obs.probs_NE.float()
        stored_CE = self.store.maps_CLE[:, layer]
        dots, norm2, own2 = p_NE @ stored_CE.T, self.store.derived().norm2_LC[layer][None], (p_NE * p_NE).sum(1)
        if self._dots_NC is None:
            self._dots_NC, self._norm2_NC, self._own2_N = dots, norm2, own2
        else:
            self._dots_NC, self._norm2_NC, self._own2_N = self._dots_NC + dots, self._norm2_NC + norm2, \
                self._own2_N + own2
        self._observed.append(p_NE)

    def forecast(self, layer: int, ahead: int) -> Forecast | None:
        if len(self.store.maps_CLE) == 0:
            return None
        if ahead == 0 and self._dots_NC is not None:
            score_NC = self._dots_NC / (self._own2_N[:, None] * self._norm2_NC).sqrt().clamp(min=1e-12)
        elif self.store.sem_kind != "none" and self._sem_ND is not None and \
                self._sem_ND.shape[1] == self.store.sem_CD.shape[1]:
            score_NC = F.normalize(self._sem_ND, dim=1) @ self.store.derived().sem_unit_CD.T
        elif self.store.sem_kind == "none" and ahead == 0 and self._rows():  # trajectory-only, nothing observed
            return Forecast(self.store.maps_CLE[:, layer].mean(0, keepdim=True).expand(self._rows(), -1))
        else:
            return None
        m = min(self.store.neighbours, score_NC.shape[1])
        if m == 1:
            best_N, y_N = score_NC.max(1)
            return Forecast(self.store.maps_CLE[y_N, layer], best_N)
        best_NM, y_NM = score_NC.topk(m, dim=1)
        weight_NM = best_NM.clamp(min=0) + 1e-6
        probs_NE = (weight_NM[..., None] * self.store.maps_CLE[y_NM, layer]).sum(1) / weight_NM.sum(1, keepdim=True)
        return Forecast(probs_NE, best_NM[:, 0])

    def _rows(self) -> int:
        """Rows of this iteration: observed ones, else its tokens (0 when neither is known yet)."""
        return len(self._observed[0]) if self._observed else self._tokens

    def _finish_iteration(self) -> None:
        """Online mode: a fully observed iteration becomes a stored map."""
        if self.learn and self._sem_ND is not None and len(self._observed) == self.store.num_layers:
            self.store.add(self._sem_ND, torch.stack(self._observed, 1))
