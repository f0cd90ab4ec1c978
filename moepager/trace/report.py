"""Sweeps of policies x capacities over one workload, their summary rows, and the hit-rate plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moepager.planning.cost import CostModel
from moepager.trace.format import DECODE, PREFILL
from moepager.trace.simulate import SimResult, drive_of
from moepager.trace.workload import Workload


def summary(result: SimResult, work: Workload, cost: CostModel | None) -> dict[str, Any]:
    """One row: hit rates (overall, per phase, per layer), traffic, and modeled TPOT/TTFT when costed."""
    h = work.header
    tokens = int(result.step_tokens.sum())
    row: dict[str, Any] = {
        "policy": result.spec.policy, "forecast": result.spec.forecast, "prefetch": result.spec.prefetch,
        "horizon": result.spec.horizon, "capacity": result.spec.capacity,
        "scope": result.spec.scope, "hit_rate": result.hit_rate(), "prefill_hit_rate": result.hit_rate(PREFILL),
        "decode_hit_rate": result.hit_rate(DECODE), "misses": result.misses, "loads": result.loads,
        "prefetch_loads": int(result.prefetch_loads_SL.sum()), "prefetch_used": int(result.prefetch_used_SL.sum()),
        "loads_per_token": result.loads / max(tokens, 1), "tokens": tokens, "steps": len(result.step_tokens),
        "sim_wall_s": result.wall_s, "layer_hit_rates": result.layer_hit_rates().round(4).tolist(),
        "execution": result.spec.execution, "admit": result.spec.admit,
        "on_cpu_per_token": float(result.cpu_SL.sum()) / max(tokens, 1),
    }
    if h.expert_bytes:
        row["bytes_moved"] = result.loads * h.expert_bytes
        row["bytes_per_token"] = row["bytes_moved"] / max(tokens, 1)
    if cost is not None:
        t_S = step_seconds(result, work, cost)
        decode = result.step_phase == DECODE
        row["tpot_ms"] = 1e3 * float(t_S[decode].sum() / max(result.step_tokens[decode].sum(), 1))
        row["ttft_ms"] = 1e3 * float(t_S[~decode].mean()) if (~decode).any() else None
    return row


def with_gaps(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with the share of the LRU -> Belady gap it closes, in hits and in bytes moved (demand + prefetch
    loads), where the same run has LRU and Belady at its capacity and scope (plain, no forecast or prefetch). A
    prefetched expert that is used is a hit but still cost a transfer: in bytes it counts as one, which is why a
    prefetching row can close much of the gap in hits and little or none in bytes. Belady is demand-only, so
    a prefetching row can pass 100% in hits, never in bytes."""
    plain = {(r["policy"], r["capacity"], r["scope"]): r for r in rows
             if r["forecast"] == "none" and not r.get("prefetch") and r.get("horizon", 1) == 1}
    out = []
    for r in rows:
        lru, belady = plain.get(("lru", r["capacity"], r["scope"])), plain.get(("belady", r["capacity"], r["scope"]))
        r = dict(r)
        if lru is not None and belady is not None:
            hits = belady["hit_rate"] - lru["hit_rate"]
            loads = lru["loads"] - belady["loads"]
            r["gap_closed_hits"] = (r["hit_rate"] - lru["hit_rate"]) / hits if hits > 0 else None
            r["gap_closed_bytes"] = (lru["loads"] - r["loads"]) / loads if loads > 0 else None
        out.append(r)
    return out


def step_seconds(result: SimResult, work: Workload, cost: CostModel) -> np.ndarray:
    """The cost model's seconds for every replayed step, in order."""
    on_cpu = not drive_of(result.spec.policy).admits_on_miss
    return cost.step_times(result.requested_SL, result.hits_SL, result.prefetch_loads_SL, result.step_tokens,
                           work.header.top_k, on_cpu, work.step_kv(), result.cpu_SL)


def _label(row: dict[str, Any]) -> str:
    """A summary row's policy, forecast (with its horizon past 1 step) and prefetch, e.g. plec/predictor+pf1,
    plec/oracle4."""
    return row["policy"] + (f"/{row['forecast']}" if row["forecast"] != "none" else "") + \
        (f"{row['horizon']}" if row.get("horizon", 1) > 1 else "") + \
        (f"+pf{row['prefetch']}" if row.get("prefetch") else "") + \
        (("/hybrid" + (f"+admit{row['admit']}" if row.get("admit") else "")) if row.get("execution") == "hybrid"
         else "")


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a table; with LRU and Belady among them, each row's share of their gap closed in hits and in
    bytes moved (`with_gaps`), and prefetched experts used against loaded where there are any."""
    rows = with_gaps(rows)
    gaps = any("gap_closed_bytes" in r for r in rows)
    prefetching = any(r.get("prefetch_loads") for r in rows)
    head = ["policy", "capacity", "hit %", "prefill %", "decode %", "loads/token", "MiB/token", "TPOT ms",
            "TTFT ms", "sim s"] + (["gap % hits", "gap % bytes"] if gaps else []) + \
        (["prefetched used/loaded"] if prefetching else [])

    def pct(x: float) -> str:
        return "-" if x is None or np.isnan(x) else f"{100 * x:.1f}"

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    lines = [head]
    for r in rows:
        name = _label(r)
        lines.append([name, f"{r['capacity']}{' global' if r['scope'] == 'global' else ''}", pct(r["hit_rate"]),
                      pct(r["prefill_hit_rate"]), pct(r["decode_hit_rate"]), f"{r['loads_per_token']:.2f}",
                      num(r.get("bytes_per_token", 0) / 2**20 if "bytes_per_token" in r else None, ".1f"),
                      num(r.get("tpot_ms"), ".2f"), num(r.get("ttft_ms"), ".1f"), f"{r['sim_wall_s']:.1f}"]
                     + ([pct(r.get("gap_closed_hits")), pct(r.get("gap_closed_bytes"))] if gaps else [])
                     + ([f"{r.get('prefetch_used', 0)}/{r.get('prefetch_loads', 0)}"] if prefetching else []))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def plot_hit_rates(rows: Sequence[dict[str, Any]], path: str | Path, title: str) -> None:
    """Hit rate vs cache size, one line per policy (and forecast)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        name = _label(r)
        lines.setdefault(name, []).append((r["capacity"], 100 * r["hit_rate"]))
    for name, points in lines.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name,
                linestyle="--" if name.startswith("belady") else "-")
    scope = "global" if rows and rows[0]["scope"] == "global" else "per layer"
    ax.set(xlabel=f"cached experts ({scope})", ylabel="hit rate (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
