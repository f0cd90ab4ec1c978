"""ExpertFlow's token scheduler (§3.3.3): sequences grouped by the similarity of their routing paths, so that each
decode step activates fewer distinct experts.

A sequence's path is the set of experts its next token is expected to use at every MoE layer, a bit per (layer,
expert) (the engine's: runtime/batch_policy/expertflow.py `PathTracker`; the simulator's: from the trace).
`balanced_two_means` splits paths into two groups of sizes ceil(n/2) and floor(n/2) by balanced 2-means on Hamming
similarity (eq. 6, S[i, j] = 1 - Hamming(r_i, r_j) / (L E)):
1. medoids: the oldest sequence, and the one least similar to it (ties: the older);
2. assign: sort by S[i, c1] - S[i, c2], descending (stable: older first on ties); the first ceil(n/2) form group 1;
3. each group's new medoid is its member most similar on average to the others (ties: the older);
4. repeat 2-3 until the groups stop changing, at most `iters` times.
Deterministic: the same paths give the same groups. The objective is the sum over the two groups of their distinct
(layer, expert) pairs (eq. 4-5 with the union, as the digest corrects).

The engine's grouping (`group`) follows 2-means with a local search on that objective (`swap_search`: the best swap of
one member of each group, until none lowers it). A path may also be a forecast's probabilities of each (layer,
expert) (ExpertFlow's path predictor: runtime/batch_policy/expertflow.py), and then both steps read them as such:
2-means's Hamming similarity becomes its expectation, and the search lowers the expected distinct pairs. The paper
stops at 2-means; the search is ours, and on DeepSeek-V2-Lite's held-back requests it brings the path predictor's
grouping to about the figure of 2-means on the true next token (benchmarks/README.md `grouping`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

ITERATIONS = 10
"""Most rounds of 2-means (the paper leaves it open; a handful settle on every trace tried)."""


def similarity(paths_NP: np.ndarray) -> np.ndarray:
    """S[i, j] = 1 - Hamming(path_i, path_j) / P for boolean paths [N, P] (probabilities: its expectation, the paths
    taken as independent)."""
    r = paths_NP.astype(np.float32)
    hamming = r @ (1 - r).T + (1 - r) @ r.T
    return 1 - hamming / max(paths_NP.shape[1], 1)


def union_size(paths_NP: np.ndarray, members: Sequence[int]) -> int:
    """Distinct (layer, expert) pairs the `members` activate together."""
    return int(paths_NP[list(members)].any(0).sum()) if len(members) else 0


def balanced_two_means(paths_NP: np.ndarray, iters: int = ITERATIONS) -> tuple[list[int], list[int]]:
    """Rows of `paths_NP` split into two groups of ceil(n/2) and floor(n/2), each in ascending order (module note)."""
    n = len(paths_NP)
    if n < 2:
        return list(range(n)), []
    s = similarity(paths_NP)
    c1 = 0
    c2 = int(np.argmin(np.where(np.arange(n) == c1, np.inf, s[c1])))
    half = (n + 1) // 2
    groups: tuple[list[int], list[int]] | None = None
    for _ in range(iters):
        order = np.argsort(-(s[:, c1] - s[:, c2]), kind="stable")
        new = (sorted(order[:half].tolist()), sorted(order[half:].tolist()))
        if new == groups:
            break
        groups = new
        c1, c2 = (_medoid(s, g) for g in groups)
    assert groups is not None
    return groups


def path_of(ids_LK: np.ndarray, num_experts: int) -> np.ndarray:
    """One token's path: a bit per (layer, expert) it routes to, [L * E] (negative ids: not recorded, left out)."""
    path = np.zeros((len(ids_LK), num_experts), bool)
    for layer, ids in enumerate(ids_LK):
        path[layer, ids[ids >= 0]] = True
    return path.reshape(-1)


def _medoid(s: np.ndarray, members: list[int]) -> int:
    """The member most similar on average to the others (the first on ties)."""
    block = s[np.ix_(members, members)]
    return members[int(np.argmax(block.sum(1)))]


def split_cost(paths_NP: np.ndarray, a: Sequence[int], b: Sequence[int]) -> int:
    """The objective of a split: distinct (layer, expert) pairs of group `a` plus those of group `b`."""
    return union_size(paths_NP, a) + union_size(paths_NP, b)


def exact_best_split(paths_NP: np.ndarray) -> tuple[list[int], list[int]]:
    """The balanced split (ceil(n/2), floor(n/2)) of least `split_cost`, by trying every one with row 0 in the first
    group (n <= 20: C(16, 8) / 2 = 6,435 splits at 16): a bound for the scheduler's grouping, never run by the
    engine. Ties: the first split in lexicographic order of the first group."""
    n = len(paths_NP)
    if n > 20:
        raise ValueError(f"an exact split of {n} paths tries too many ({n} > 20): use swap_search")
    if n < 2:
        return list(range(n)), []
    half = (n + 1) // 2
    firsts = [(0, *rest) for rest in itertools.combinations(range(1, n), half - 1)]
    if n % 2:  # odd n: the smaller group may hold row 0 too
        firsts += list(itertools.combinations(range(1, n), half))
    masks = np.zeros((len(firsts), n), np.float32)
    for i, group in enumerate(firsts):
        masks[i, list(group)] = 1
    paths = paths_NP.astype(np.float32)
    cost = ((masks @ paths) > 0).sum(1) + (((1 - masks) @ paths) > 0).sum(1)
    best = firsts[int(np.argmin(cost))]
    return list(best), [i for i in range(n) if i not in best]


def swap_search(paths_NP: np.ndarray, a: Sequence[int], b: Sequence[int], rounds: int = 200
                ) -> tuple[list[int], list[int]]:
    """Local search from the split (a, b): the swap of one member of each group that lowers the split's cost the
    most, repeated until none lowers it (or `rounds` swaps). Group sizes are kept. Boolean paths: the cost is
    `split_cost`, the distinct (layer, expert) pairs. Probabilities in [0, 1] (a predictor's forecast of each pair):
    the expected distinct pairs, over the pairs of each group 1 - prod over its members (1 - p), what a forecast's
    uncertainty says the step will activate (`expected_cost`)."""
    a, b = list(a), list(b)
    soft = paths_NP.dtype != np.bool_
    # per member and pair, what adds up over a group: a use (count > 0: activated), or log(1 - p) (1 - exp: the
    # probability that someone activates it)
    paths = _log_unused(paths_NP) if soft else paths_NP.astype(np.int32)

    def used(sums: np.ndarray) -> np.ndarray:
        return _expected_used(sums) if soft else (sums > 0).sum(-1)

    for _ in range(rounds):
        ca, cb = paths[a].sum(0), paths[b].sum(0)
        now = used(ca) + used(cb)
        pa, pb = paths[a], paths[b]  # [|a|, P], [|b|, P]
        # swapping a[i] and b[j]: group a's sums ca - pa[i] + pb[j], group b's cb - pb[j] + pa[i]
        total = used(ca[None, None] - pa[:, None] + pb[None, :]) + used(cb[None, None] - pb[None, :] + pa[:, None])
        i, j = np.unravel_index(int(np.argmin(total)), total.shape)
        if total[i, j] >= now - (1e-9 if soft else 0):
            break
        a[i], b[j] = b[j], a[i]
    return sorted(a), sorted(b)


def expected_cost(paths_NP: np.ndarray, a: Sequence[int], b: Sequence[int]) -> float:
    """The expected distinct (layer, expert) pairs of the split (a, b) for paths given as probabilities (boolean paths:
    `split_cost`)."""
    logs = _log_unused(paths_NP)
    return float(sum(_expected_used(logs[list(g)].sum(0)) for g in (a, b) if len(g)))


def _log_unused(paths_NP: np.ndarray) -> np.ndarray:
    """log(1 - p) per member and pair (p clipped below 1, so a certain pair stays finite): summed over a group, the
    log of the probability that no member uses the pair."""
    return np.log1p(-np.minimum(paths_NP.astype(np.float64), 1 - 1e-9))


def _expected_used(log_unused_sums: np.ndarray) -> np.ndarray:
    """The expected distinct pairs of a group (over the last axis) from its members' `_log_unused` sums."""
    return (1 - np.exp(log_unused_sums)).sum(-1)


def group(paths_NP: np.ndarray) -> tuple[list[int], list[int]]:
    """The token scheduler's grouping: `balanced_two_means`, then `swap_search` from its split (on a forecast's
    probabilities, their expected distinct pairs)."""
    return swap_search(paths_NP, *balanced_two_means(paths_NP))
