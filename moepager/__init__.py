"""moepager: run Mixture-of-Experts LLMs whose experts do not fit in fast memory.

`from moepager import LLM, SamplingParams` loads the engine when first asked for, not at import: the simulator,
the policies and the trace tools import `moepager.<package>` without loading torch's model code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moepager.runtime.llm import LLM
    from moepager.runtime.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {"LLM": "moepager.runtime.llm", "SamplingParams": "moepager.runtime.sampling"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moepager' has no attribute {name!r}")
