"""Statistics of one generation run: latency (TTFT, TPOT), throughput and peak memory.

Other subsystems add their own sections (the expert store adds its counters) through `sections`.
"""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import torch

from moepager.atomic_io import atomic_file


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile of `values` (q in [0, 100]); 0 for an empty list."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class Section(Protocol):
    """A subsystem's part of the statistics: rows for the table, a dict for JSON."""

    def rows(self) -> list[tuple[str, str]]: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass
class RunStats:
    """What one `generate` call measured. Times in seconds."""

    num_prompts: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    """Mean over the requests of the time from joining the engine to their first sampled token."""
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tpot_s: list[float] = field(default_factory=list)
    """Duration of every decode step (one token for every unfinished prompt)."""
    threads: int = 0
    experts: str = ""
    """The format routed experts ran in (bfloat16, int8, int4 ...; quantized formats are lossy)."""
    dense: str = ""
    """The format the dense projections ran in (the run's dtype, or int8: lossy)."""
    cpu_kernels: str = ""
    """The tier of moepager's CPU kernels the process ran (accel/cpu_tiers.py: avx512-bf16, avx2, ..., torch); "" when
    none was chosen (a run that never needed them)."""
    peak_rss_bytes: int = 0
    peak_cuda_bytes: int | None = None
    graph_replays: int | None = None
    """Decode passes replayed from CUDA graphs (runtime/cuda_graphs.py); None where the engine has none."""
    sections: dict[str, Section] = field(default_factory=dict)

    @property
    def tpot_median_s(self) -> float:
        return percentile(self.tpot_s, 50)

    @property
    def tpot_p90_s(self) -> float:
        return percentile(self.tpot_s, 90)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by decode steps (all but each prompt's first) per second of decoding."""
        decoded = self.generated_tokens - self.num_prompts
        return decoded / self.decode_s if self.decode_s and decoded > 0 else 0.0

    def add(self, part: RunStats) -> None:
        """Fold in a run of further prompts made after this one (sequential requests): counts, times and
        TPOTs add up; TTFT becomes the mean over the runs."""
        runs = self.num_prompts
        self.ttft_s = (self.ttft_s * runs + part.ttft_s * part.num_prompts) / max(1, runs + part.num_prompts)
        self.num_prompts += part.num_prompts
        self.prompt_tokens += part.prompt_tokens
        self.generated_tokens += part.generated_tokens
        self.prefill_s += part.prefill_s
        self.decode_s += part.decode_s
        self.tpot_s += part.tpot_s
        if part.graph_replays is not None:
            self.graph_replays = (self.graph_replays or 0) + part.graph_replays

    def finish(self, device: torch.device) -> None:
        self.peak_rss_bytes = peak_rss_bytes()
        if device.type == "cuda":
            self.peak_cuda_bytes = torch.cuda.max_memory_allocated(device)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sections"}
        out["tpot_s"] = list(self.tpot_s)
        out.update({name: section.to_dict() for name, section in self.sections.items()})
        out.update(tpot_median_s=self.tpot_median_s, tpot_p90_s=self.tpot_p90_s,
                   prefill_tokens_per_s=self.prefill_tokens_per_s, decode_tokens_per_s=self.decode_tokens_per_s)
        return out

    def write_json(self, path: str | Path) -> None:
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    def table(self) -> str:
        rows = [
            ("prompts", f"{self.num_prompts}"),
            ("prompt tokens", f"{self.prompt_tokens}"),
            ("generated tokens", f"{self.generated_tokens}"),
            ("TTFT", f"{self.ttft_s * 1e3:.1f} ms"),
            ("TPOT median", f"{self.tpot_median_s * 1e3:.2f} ms"),
            ("TPOT p90", f"{self.tpot_p90_s * 1e3:.2f} ms"),
            ("prefill", f"{self.prefill_tokens_per_s:.1f} tok/s"),
            ("decode", f"{self.decode_tokens_per_s:.1f} tok/s"),
            ("threads", f"{self.threads}"),
            ("expert format", self.experts + (" (lossy)" if self.experts.startswith("int") else "")),
            ("dense format", self.dense + (" (lossy)" if self.dense.startswith("int") else "")),
            *([("CPU kernels", self.cpu_kernels)] if self.cpu_kernels else []),
            ("peak RSS", f"{self.peak_rss_bytes / 2**20:.0f} MiB"),
        ]
        if self.peak_cuda_bytes is not None:
            rows.append(("peak CUDA memory", f"{self.peak_cuda_bytes / 2**20:.0f} MiB"))
        if self.graph_replays is not None:
            rows.append(("CUDA graphs", f"{self.graph_replays} decode passes replayed"))
        for section in self.sections.values():
            rows += section.rows()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)

