"""On the main rank of a --shadow run: each pass announced to the shadow rank (runtime/shadow.py) before it runs."""

from __future__ import annotations

import datetime
import sys

import torch

from moepager.experts.remote.protocol import SHADOW_RANK, Pass, send
from moepager.types import PassInfo


class ShadowFeed:
    """On the main rank: each pass's rows and tokens to the shadow rank before the pass runs (a pass part). A shadow
    that does not take a pass within twice `timeout_s` (--worker-timeout; its own forecast to a worker that stopped
    answering may hold it up for one timeout), or is gone, is left behind with one line: the run goes on without its
    forecasts, which only load ahead."""

    def __init__(self, timeout_s: float):
        self.timeout = datetime.timedelta(seconds=2 * timeout_s)
        self.lost = False

    def begin_pass(self, info: PassInfo) -> None:
        if self.lost:
            return
        rows = torch.tensor([[r, s, c, phase == "decode"] for r, s, c, phase in
                             zip(info.requests, info.starts, info.counts, info.row_phases)])
        announced = Pass(len(info.requests), len(info.token_ids_N), info.pass_id)
        try:  # gloo's: host tensors
            send(announced, [rows, info.token_ids_N.to("cpu", torch.long).contiguous()], SHADOW_RANK, None,
                 self.timeout)
        except RuntimeError as e:
            self.lost = True
            print(f"shadow rank {SHADOW_RANK} did not take pass {info.pass_id} "
                  f"({str(e).splitlines()[0].split('] ')[-1][:120]}): going on without its forecasts", file=sys.stderr)
