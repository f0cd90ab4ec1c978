"""On the main rank of a --shadow run: each pass announced to the shadow rank (runtime/shadow.py) before it runs."""

from __future__ import annotations

import datetime
import sys
from dataclasses import asdict, dataclass

import torch

from moepager.experts.remote.kv_align import KVAligner
from moepager.experts.remote.protocol import DTYPES, SHADOW_RANK, Pass, send
from moepager.types import KVCacheHolder, PassInfo


class ShadowFeed:
    """On the main rank: each pass's rows and tokens to the shadow rank before the pass runs (a pass part), with the
    KV cache entries computed since (KV alignment, `kv_align_period` > 0, once `bind_kv` gave it the cache). A shadow
    that does not take a pass within twice `timeout_s` (--worker-timeout; its own forecast to a worker that stopped
    answering may hold it up for one timeout), or is gone, is left behind with one line: the run goes on without its
    forecasts, which only load ahead."""

    def __init__(self, timeout_s: float, kv_align_period: int = 0):
        self.timeout = datetime.timedelta(seconds=2 * timeout_s)
        self.lost = False
        self.aligner = KVAligner(kv_align_period) if kv_align_period else None
        """OD-MoE's KV alignment (experts/remote/kv_align.py); None: off (--kv-align-period 0)."""
        self.kv: KVCacheHolder | None = None
        """The engine's KV pool, whose entries the shadow is sent (`bind_kv`, once the engine exists)."""

    def bind_kv(self, pool: KVCacheHolder) -> None:
        self.kv = pool

    report_name = "kv alignment"

    def reset_report(self) -> None:
        if self.aligner is not None:
            self.aligner.positions = self.aligner.bytes = 0

    def report(self) -> AlignReport | None:
        a = self.aligner
        return AlignReport(a.period, a.positions, a.bytes, self.lost) if a is not None else None

    def begin_pass(self, info: PassInfo) -> None:
        if self.lost:
            return
        rows = torch.tensor([[r, s, c, phase == "decode"] for r, s, c, phase in
                             zip(info.requests, info.starts, info.counts, info.row_phases)])
        tensors = [rows, info.token_ids_N.to("cpu", torch.long).contiguous()]
        kv: tuple[int, ...] = ()
        if self.aligner is not None and self.kv is not None:
            aligned = self.aligner.payload(info, self.kv)
            if aligned is not None:
                spans, entries = aligned
                kv = (len(spans), len(entries), DTYPES.index(entries.dtype))
                tensors += [spans, entries]
        announced = Pass(len(info.requests), len(info.token_ids_N), info.pass_id, *kv)
        try:  # gloo's: host tensors
            send(announced, tensors, SHADOW_RANK, None, self.timeout)
        except RuntimeError as e:
            self.lost = True
            print(f"shadow rank {SHADOW_RANK} did not take pass {info.pass_id} "
                  f"({str(e).splitlines()[0].split('] ')[-1][:120]}): going on without its forecasts", file=sys.stderr)


@dataclass(frozen=True)
class AlignReport:
    """OD-MoE's KV alignment in a call's statistics: what the main rank sent the shadow."""

    period: int
    positions: int
    bytes: int
    lost: bool
    """The shadow was left behind (nothing more was sent)."""

    def to_dict(self) -> dict[str, int | bool]:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        lost = "; the shadow was left behind" if self.lost else ""
        return [("shadow KV alignment", f"{self.positions} positions ({self.bytes / 2**20:.2f} MiB) sent, every "
                                        f"{self.period} passes{lost}")]
