"""Trace format v1: routing decisions of many requests, one compressed file, read one request at a time.

A trace file is a ZIP archive (deflate) so it streams and any zip tool can look inside:
    header.json                         TraceHeader
    requests/<i>/meta.json              name, prompt, token strings, free-form metadata
    requests/<i>/ids_TLK.npy            int16 expert ids; -1 where the recorder has no entry (dropped)
    requests/<i>/phase_T.npy            uint8: 0 prefill, 1 decode
    requests/<i>/weights_TLK.npy        optional float32 routing weights of those experts
    requests/<i>/gates_TLE.npy          optional float32 full gate distribution (router scores)
    requests/<i>/token_ids_T.npy        optional int64 token ids
    requests/<i>/hidden_TLD.npy         optional float16 router inputs (hidden states; `--record-hidden`)
    priors/<name>.npy                   optional float64 [L, E] activation counts (frequency priors)
Axis L is the traced MoE layers in order; `header.moe_layers[l]` is that layer's decoder-layer index.
Shape legend: T tokens, L traced MoE layers, K top-k, E experts per layer, D hidden size.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moepager.errors import MoepagerError

SCHEMA_VERSION = 1
PREFILL, DECODE = 0, 1
MISSING = -1


class TraceError(MoepagerError):
    """A trace file or a source to convert is missing, malformed or of another schema version."""


@dataclass(frozen=True)
class TraceHeader:
    model: str
    """Name of the model the routing came from."""
    moe_layers: tuple[int, ...]
    """Decoder-layer index of each traced MoE layer (the L axis)."""
    num_experts: int
    """Routed experts per layer (E)."""
    top_k: int
    """Experts each token is routed to per layer (K)."""
    num_shared: int = 0
    """Always-on shared experts per layer (never paged, listed for cost models)."""
    expert_bytes: int = 0
    """Bytes of one routed expert's weights as served; 0 when unknown."""
    source: str = ""
    """Where the routing came from (recorder, converter and input)."""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.top_k < 1 or self.top_k > self.num_experts or not self.moe_layers:
            raise TraceError(f"invalid trace header: {self.num_experts} experts, top-{self.top_k}, "
                             f"{len(self.moe_layers)} MoE layers")

    @property
    def num_layers(self) -> int:
        return len(self.moe_layers)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TraceHeader:
        version = raw.get("schema_version")
        if version != SCHEMA_VERSION:
            raise TraceError(f"trace schema version {version} is not supported (this moepager reads {SCHEMA_VERSION})")
        try:
            return cls(**{**raw, "moe_layers": tuple(raw["moe_layers"])})
        except (TypeError, KeyError) as e:
            raise TraceError(f"malformed trace header: {e}") from None


@dataclass
class TraceRequest:
    ids_TLK: np.ndarray
    phase_T: np.ndarray
    weights_TLK: np.ndarray | None = None
    gates_TLE: np.ndarray | None = None
    token_ids_T: np.ndarray | None = None
    tokens: list[str] | None = None
    prompt: str | None = None
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    hidden_TLD: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.phase_T)

    def validate(self, header: TraceHeader) -> None:
        """Shapes agree with the header; ids are in range and distinct per (token, layer)."""
        t, want = self.num_tokens, (header.num_layers, header.top_k)
        where = f"request '{self.name}'"
        if self.ids_TLK.shape != (t, *want):
            raise TraceError(f"{where}: ids shape {self.ids_TLK.shape}, expected {(t, *want)}")
        if self.weights_TLK is not None and self.weights_TLK.shape != self.ids_TLK.shape:
            raise TraceError(f"{where}: weights shape {self.weights_TLK.shape} != ids shape {self.ids_TLK.shape}")
        if self.gates_TLE is not None and self.gates_TLE.shape != (t, header.num_layers, header.num_experts):
            raise TraceError(f"{where}: gates shape {self.gates_TLE.shape}, expected "
                             f"{(t, header.num_layers, header.num_experts)}")
        if self.ids_TLK.size and (self.ids_TLK.min() < MISSING or self.ids_TLK.max() >= header.num_experts):
            raise TraceError(f"{where}: expert ids outside 0..{header.num_experts - 1}")
        ids = np.sort(self.ids_TLK, axis=-1)
        if np.any((ids[..., 1:] == ids[..., :-1]) & (ids[..., 1:] != MISSING)):
            raise TraceError(f"{where}: an expert appears twice in one token's top-{header.top_k}")
        if not np.isin(self.phase_T, (PREFILL, DECODE)).all():
            raise TraceError(f"{where}: phase values must be 0 (prefill) or 1 (decode)")
        if self.hidden_TLD is not None and self.hidden_TLD.shape[:2] != (t, header.num_layers):
            raise TraceError(f"{where}: hidden shape {self.hidden_TLD.shape}, expected {(t, header.num_layers)} + (D,)")
        for name in ("token_ids_T", "tokens"):
            value = getattr(self, name)
            if value is not None and len(value) != t:
                raise TraceError(f"{where}: {len(value)} {name} for {t} tokens")


_ARRAYS = ("ids_TLK", "phase_T", "weights_TLK", "gates_TLE", "token_ids_T", "hidden_TLD")
_DTYPES = {"ids_TLK": np.int16, "phase_T": np.uint8, "weights_TLK": np.float32, "gates_TLE": np.float32,
           "token_ids_T": np.int64, "hidden_TLD": np.float16}


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


class TraceWriter:
    """Appends requests (and priors) to a new trace file; use as a context manager."""

    def __init__(self, path: str | Path, header: TraceHeader):
        self.path, self.header = Path(path), header
        if not self.path.parent.is_dir():
            raise TraceError(f"cannot write {self.path}: directory {self.path.parent} does not exist")
        self._zip = zipfile.ZipFile(self.path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6)
        self._zip.writestr("header.json", json.dumps(asdict(header), indent=1))
        self.count = 0

    def add(self, request: TraceRequest) -> None:
        request.validate(self.header)
        prefix = f"requests/{self.count:07d}/"
        meta = {"name": request.name, "prompt": request.prompt, "tokens": request.tokens, "meta": request.meta}
        self._zip.writestr(prefix + "meta.json", json.dumps(meta, ensure_ascii=False))
        for name in _ARRAYS:
            value = getattr(request, name)
            if value is not None:
                self._zip.writestr(prefix + name + ".npy", _npy_bytes(np.ascontiguousarray(value, _DTYPES[name])))
        self.count += 1

    def add_prior(self, name: str, counts_LE: np.ndarray) -> None:
        want = (self.header.num_layers, self.header.num_experts)
        if counts_LE.shape != want:
            raise TraceError(f"prior '{name}' has shape {counts_LE.shape}, expected {want}")
        self._zip.writestr(f"priors/{name}.npy", _npy_bytes(counts_LE.astype(np.float64)))

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TraceReader:
    """Opens a trace file; iterating yields requests one at a time (only the zip directory is held)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            what = "is a directory, not a trace file" if self.path.is_dir() else \
                "is not a regular file" if self.path.exists() else "does not exist"
            raise TraceError(f"trace file {self.path} {what}")
        try:
            self._zip = zipfile.ZipFile(self.path)
            self.header = TraceHeader.from_json(json.loads(self._zip.read("header.json")))
        except (zipfile.BadZipFile, KeyError, json.JSONDecodeError) as e:
            raise TraceError(f"{self.path} is not a moepager trace file ({e})") from None
        names = self._zip.namelist()
        self._requests = sorted({n.split("/")[1] for n in names if n.startswith("requests/")})
        self.prior_names = sorted(n[len("priors/"):-len(".npy")] for n in names if n.startswith("priors/"))

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        for i in range(len(self._requests)):
            yield self.request(i)

    def request(self, i: int) -> TraceRequest:
        prefix = f"requests/{self._requests[i]}/"
        try:
            meta = json.loads(self._zip.read(prefix + "meta.json"))
            arrays = {name: self._array(prefix + name + ".npy") for name in _ARRAYS}
        except (zipfile.BadZipFile, KeyError, ValueError, OSError) as e:
            raise TraceError(f"{self.path}: request {i} is corrupt ({e})") from None
        if arrays["ids_TLK"] is None or arrays["phase_T"] is None:
            raise TraceError(f"{self.path}: request {i} lacks ids_TLK or phase_T")
        request = TraceRequest(**arrays, tokens=meta.get("tokens"), prompt=meta.get("prompt"),
                               name=meta.get("name", ""), meta=meta.get("meta") or {})
        request.validate(self.header)
        return request

    def prior(self, name: str) -> np.ndarray:
        if name not in self.prior_names:
            raise TraceError(f"{self.path} has no prior '{name}'; it has {self.prior_names}")
        return self._array(f"priors/{name}.npy")

    def _array(self, name: str) -> np.ndarray | None:
        try:
            info = self._zip.getinfo(name)
        except KeyError:
            return None
        with self._zip.open(info) as f:
            return np.load(io.BytesIO(f.read()), allow_pickle=False)

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
