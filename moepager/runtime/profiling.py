"""Counting the Python work of a decode token: what tests guard and benchmarks/overhead.py reports."""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import moepager
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams

PACKAGE_ROOT = os.path.dirname(moepager.__file__)


def calls_per_decode_token(llm: LLM, prompt: str = "The history of") -> float:
    """moepager's own Python calls per decode token: a 17-token generation less a 1-token one, over 16 steps, after
    a warm-up (first-call set-up such as fused projections is not per-token work)."""
    def calls(max_tokens: int) -> int:
        count = 0

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            nonlocal count
            if event == "call" and frame.f_code.co_filename.startswith(PACKAGE_ROOT):
                count += 1
        sys.setprofile(profile)
        try:
            llm.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        finally:
            sys.setprofile(None)
        return count
    calls(2)
    return (calls(17) - calls(1)) / 16
