"""A restricted unpickler for the OLMoE routing-statistics pickles: counters of numpy scalars, nothing else.

A plain `pickle.load` runs whatever code a file names; this one resolves only the classes those files use
(collections.Counter / defaultdict, numpy scalars and dtypes) and refuses every other global by name.
"""

from __future__ import annotations

import collections
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from moepager.trace.format import TraceError

_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "Counter"): collections.Counter,
    ("collections", "defaultdict"): collections.defaultdict,
    ("numpy.core.multiarray", "scalar"): np._core.multiarray.scalar,
    ("numpy._core.multiarray", "scalar"): np._core.multiarray.scalar,
    ("numpy", "dtype"): np.dtype,
}


class CounterUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise TraceError(f"refusing to unpickle {module}.{name}: only counters of numpy scalars "
                             "are allowed") from None


def load_counters(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            return CounterUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        raise TraceError(f"{path} is not a readable counts pickle ({e})") from None
