"""Converters from the public routing-trace formats to trace format v1 (`moepager trace convert`).

Formats (see ../shared/traces/README.md for the published sets):
- `deepseek-csv`: one CSV per prompt, `Layer ID,Batch Number,Token,Activated Expert IDs`, rows by layer then
  token, ids a JSON list (unordered). One forward pass per prompt: every token is recorded as prefill.
- `mixtral-jsonl`: one JSON object per (token, layer) with `token_idx`, `experts`, `gating_probs`; decode tokens
  only. The recorder dropped tokens whose two weights tied and renumbered `token_idx` per layer, so a layer
  with fewer entries is padded with MISSING at the end and the request's `meta.dropped_per_layer` says so.
- `mixtral-raw`: the raw stream (`token_pos`): a prefill pass, then one pass per decode token; a new pass
  starts where `layer` decreases, which aligns tokens exactly; absent entries become MISSING.
- `expert-selection-json`: one JSON file per request, a list of steps, each `{"<layer>": null | [[ids of
  token 0], ...]}` (`null` = dense layer); step 0 is the prefill batch, every later step decode.
- `olmoe-counts`: pickled `[Counter(expert -> count)]` per traced layer (one file per text domain) become
  frequency priors (`priors/<domain>`), read with a restricted unpickler; there is no time order to replay.
"""

from __future__ import annotations

import collections
import csv
import gzip
import io
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moepager.atomic_io import atomic_file, check_file
from moepager.trace.format import DECODE, MISSING, PREFILL, TraceError, TraceHeader, TraceRequest, TraceWriter
from moepager.trace.pickles import load_counters

Progress = Callable[[Iterable[Any], int], Iterable[Any]]


def no_progress(items: Iterable[Any], total: int) -> Iterable[Any]:
    return items


@dataclass(frozen=True)
class ConvertOptions:
    model: str | None = None
    """Model name for the header (each format has a default for its published set)."""
    num_experts: int | None = None
    """Experts per layer (default: the published model's, or the largest id seen + 1)."""
    top_k: int | None = None
    expert_bytes: int | None = None
    """Bytes per expert as served (default: the published model's bf16 size, where known)."""
    layers: tuple[int, ...] | None = None
    """olmoe-counts: decoder-layer index of each counter in a file (default 0, 7, 15)."""

    def __post_init__(self) -> None:
        if self.num_experts is not None and self.num_experts < 1:
            raise TraceError(f"--num-experts must be >= 1, got {self.num_experts}")
        if self.top_k is not None and not 1 <= self.top_k <= (self.num_experts or self.top_k):
            raise TraceError(f"--top-k must be between 1 and the experts per layer, got {self.top_k}")
        if self.expert_bytes is not None and self.expert_bytes < 1:
            raise TraceError(f"--expert-bytes must be >= 1, got {self.expert_bytes}")
        if self.layers is not None and any(layer < 0 for layer in self.layers):
            raise TraceError(f"--layers are decoder-layer indices (>= 0), got {list(self.layers)}")


@dataclass(frozen=True)
class ConvertSummary:
    requests: int
    tokens: int
    missing_entries: int
    priors: int


def _open_text(path: Path) -> io.TextIOBase:
    if not path.is_file():
        raise TraceError(f"{path} does not exist")
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _sources(src: Path, pattern: str) -> list[Path]:
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise TraceError(f"{src} does not exist")
    found = [p for p in src.rglob("*") if p.is_file() and re.fullmatch(pattern, p.name)]
    if not found:
        raise TraceError(f"no files matching {pattern} under {src}")
    number = re.compile(r"(\d+)")
    return sorted(found, key=lambda p: (str(p.parent), [int(n) if n.isdigit() else n for n in number.split(p.name)]))


# -- DeepSeek-V2-Lite CSVs ----------------------------------------------------------------------------------
_DS_COLUMNS = ["Layer ID", "Batch Number", "Token", "Activated Expert IDs"]
# DeepSeek-V2-Lite: hidden 2048, expert FFN 1408, three matrices, bf16.
_DS_EXPERT_BYTES = 3 * 2048 * 1408 * 2


def _read_deepseek_csv(path: Path) -> tuple[np.ndarray, list[int], list[str]]:
    """ids [L, T, K], the layer ids and the tokens of one prompt's CSV."""
    with _open_text(path) as f:
        rows = csv.reader(f)
        if next(rows, None) != _DS_COLUMNS:
            raise TraceError(f"{path}: expected the header {','.join(_DS_COLUMNS)}")
        layer_col, tokens_col, ids_col = [], [], []
        for row in rows:
            if len(row) != 4:
                raise TraceError(f"{path}: malformed row {row!r}")
            layer_col.append(row[0])
            tokens_col.append(row[2])
            ids_col.append(row[3])
    try:
        layer_R = np.array(layer_col, dtype=np.int64)
        flat = ",".join(ids_col).replace("[", "").replace("]", "").split(",")
        ids_RK = np.array(flat, dtype=np.int64).reshape(len(ids_col), -1)
    except ValueError as e:
        raise TraceError(f"{path}: unreadable layer or expert ids ({e})") from None
    layers, counts = np.unique(layer_R, return_counts=True)
    if len(set(counts.tolist())) != 1 or np.any(np.diff(layer_R) < 0):
        raise TraceError(f"{path}: layers must each have the same number of tokens, rows ordered by layer")
    t = int(counts[0])
    return ids_RK.reshape(len(layers), t, -1), layers.tolist(), tokens_col[:t]


def convert_deepseek_csv(src: Path, dst: Path, opts: ConvertOptions, progress: Progress) -> ConvertSummary:
    paths = _sources(src, r"prompt_\d+_data.*\.csv(\.gz)?")
    writer, tokens = None, 0
    try:
        for path in progress(paths, len(paths)):
            ids_LTK, layers, token_strs = _read_deepseek_csv(path)
            if writer is None:
                header = TraceHeader(model=opts.model or "deepseek-ai/DeepSeek-V2-Lite-Chat", moe_layers=tuple(layers),
                                     num_experts=opts.num_experts or 64, top_k=ids_LTK.shape[2], num_shared=2,
                                     expert_bytes=opts.expert_bytes or _DS_EXPERT_BYTES,
                                     source=f"deepseek-csv:{src}")
                writer = TraceWriter(dst, header)
            if layers != list(writer.header.moe_layers):
                raise TraceError(f"{path}: layers {layers[0]}..{layers[-1]} differ from the first file's")
            t = ids_LTK.shape[1]
            writer.add(TraceRequest(ids_TLK=ids_LTK.transpose(1, 0, 2), phase_T=np.full(t, PREFILL, np.uint8),
                                    tokens=token_strs, name=str(path.relative_to(src) if src.is_dir() else path.name)))
            tokens += t
    finally:
        if writer is not None:
            writer.close()
    return ConvertSummary(len(paths), tokens, 0, 0)


# -- Mixtral JSONL ------------------------------------------------------------------------------------------
# Mixtral-8x7B: hidden 4096, expert FFN 14336, three matrices, bf16 (the published trace ran FP8 weights).
_MIXTRAL_EXPERT_BYTES = 3 * 4096 * 14336 * 2


def _json_lines(path: Path) -> Iterator[dict[str, Any]]:
    with _open_text(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{path}:{n}: not JSON ({e.msg})") from None


def _mixtral_header(opts: ConvertOptions, num_layers: int, top_k: int, src: Path, fmt: str) -> TraceHeader:
    return TraceHeader(model=opts.model or "mistralai/Mixtral-8x7B-Instruct-v0.1", moe_layers=tuple(range(num_layers)),
                       num_experts=opts.num_experts or 8, top_k=top_k,
                       expert_bytes=opts.expert_bytes or _MIXTRAL_EXPERT_BYTES, source=f"{fmt}:{src}")


def _entry(row: dict[str, Any], path: Path) -> tuple[tuple[str, int], int, list[int], list[float]]:
    try:
        return (str(row["dataset"]), int(row["problem_id"])), int(row["layer"]), list(row["experts"]), \
            list(row["gating_probs"])
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{path}: entry without dataset/problem_id/layer/experts/gating_probs ({e})") from None


def convert_mixtral_jsonl(src: Path, dst: Path, opts: ConvertOptions, progress: Progress) -> ConvertSummary:
    paths = _sources(src, r".*_routing\.jsonl(\.gz)?")
    by_request: dict[tuple[str, str, int], dict[int, list[tuple[int, list[int], list[float]]]]] = {}
    for path in progress(paths, len(paths)):
        for row in _json_lines(path):
            if "token_pos" in row:
                raise TraceError(f"{path} is a raw stream (token_pos); convert it with --format mixtral-raw")
            (dataset, problem), layer, experts, probs = _entry(row, path)
            layers = by_request.setdefault((path.name.split(".")[0], dataset, problem), {})
            layers.setdefault(layer, []).append((int(row["token_idx"]), experts, probs))
    if not by_request:
        raise TraceError(f"{src}: no routing entries")
    num_layers = 1 + max(layer for layers in by_request.values() for layer in layers)
    top_k = len(next(iter(next(iter(by_request.values())).values()))[0][1])
    missing = tokens = 0
    with TraceWriter(dst, _mixtral_header(opts, num_layers, top_k, src, "mixtral-jsonl")) as writer:
        for (stem, dataset, problem), layers in by_request.items():
            t = max(len(entries) for entries in layers.values())
            ids = np.full((t, num_layers, top_k), MISSING, np.int16)
            weights = np.zeros((t, num_layers, top_k), np.float32)
            for layer, entries in layers.items():
                entries.sort(key=lambda e: e[0])
                ids[: len(entries), layer] = [e[1] for e in entries]
                weights[: len(entries), layer] = [e[2] for e in entries]
            dropped = {layer: t - len(layers.get(layer, [])) for layer in range(num_layers)}
            dropped = {layer: n for layer, n in dropped.items() if n}
            missing += sum(dropped.values()) * top_k
            tokens += t
            writer.add(TraceRequest(ids_TLK=ids, phase_T=np.full(t, DECODE, np.uint8), weights_TLK=weights,
                                    name=f"{stem}/{dataset}/{problem}",
                                    meta={"dataset": dataset, "problem_id": problem, "dropped_per_layer": dropped,
                                          "aligned": not dropped}))
    return ConvertSummary(len(by_request), tokens, missing, 0)


def convert_mixtral_raw(src: Path, dst: Path, opts: ConvertOptions, progress: Progress) -> ConvertSummary:
    """Passes split where `layer` decreases; the first pass of each problem is its prefill."""
    passes: list[tuple[tuple[str, int], list[tuple[int, int, list[int], list[float]]]]] = []
    previous_layer = None
    for path in progress(_sources(src, r".*\.jsonl(\.gz)?"), 1):
        for row in _json_lines(path):
            if "token_pos" not in row:
                raise TraceError(f"{path}: raw-stream entries need token_pos (use --format mixtral-jsonl)")
            key, layer, experts, probs = _entry(row, path)
            if previous_layer is None or layer < previous_layer or key != passes[-1][0]:
                passes.append((key, []))
            passes[-1][1].append((layer, int(row["token_pos"]), experts, probs))
            previous_layer = layer
    if not passes:
        raise TraceError(f"{src}: no routing entries")
    num_layers = 1 + max(e[0] for _, entries in passes for e in entries)
    top_k = len(passes[0][1][0][2])
    requests: dict[tuple[str, int], list[list[tuple[int, int, list[int], list[float]]]]] = {}
    for key, entries in passes:
        requests.setdefault(key, []).append(entries)
    missing = tokens = 0
    with TraceWriter(dst, _mixtral_header(opts, num_layers, top_k, src, "mixtral-raw")) as writer:
        for (dataset, problem), request_passes in requests.items():
            prefill_t = 1 + max(e[1] for e in request_passes[0])
            t = prefill_t + len(request_passes) - 1
            ids = np.full((t, num_layers, top_k), MISSING, np.int16)
            weights = np.zeros((t, num_layers, top_k), np.float32)
            for n, entries in enumerate(request_passes):
                for layer, pos, experts, probs in entries:
                    token = pos if n == 0 else prefill_t + n - 1
                    ids[token, layer], weights[token, layer] = experts, probs
            phase = np.full(t, DECODE, np.uint8)
            phase[:prefill_t] = PREFILL
            absent = int((ids[..., 0] == MISSING).sum())
            missing += absent * top_k
            tokens += t
            writer.add(TraceRequest(ids_TLK=ids, phase_T=phase, weights_TLK=weights, name=f"{dataset}/{problem}",
                                    meta={"dataset": dataset, "problem_id": problem, "missing_entries": absent,
                                          "aligned": True}))
    return ConvertSummary(len(requests), tokens, missing, 0)


# -- "MoE expert selection trace" JSON ----------------------------------------------------------------------
def _steps_tokens(path: Path) -> tuple[dict[int, list[list[int]]], int, list[int]]:
    """Per MoE layer, every token's ids in order; the prefill token count; the MoE layers seen."""
    with _open_text(path) as f:
        try:
            steps = json.load(f)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}: not JSON ({e.msg})") from None
    if not isinstance(steps, list) or not steps or not all(isinstance(s, dict) for s in steps):
        raise TraceError(f"{path}: expected a non-empty list of steps, each a dict of layer -> token expert ids")
    per_layer: dict[int, list[list[int]]] = collections.defaultdict(list)
    step_tokens = []
    for n, step in enumerate(steps):
        sizes = {len(v) for v in step.values() if v is not None}
        if len(sizes) > 1:
            raise TraceError(f"{path}: step {n} has different token counts across layers")
        step_tokens.append(sizes.pop() if sizes else 0)
        for layer, tokens in step.items():
            if tokens is not None:
                per_layer[int(layer)].extend(tokens)
    return per_layer, step_tokens[0], sorted(per_layer)


def convert_expert_selection(src: Path, dst: Path, opts: ConvertOptions, progress: Progress) -> ConvertSummary:
    paths = _sources(src, r".*\.json(\.gz)?")
    loaded = [(path, *_steps_tokens(path)) for path in progress(paths, len(paths))]
    layers = sorted({layer for *_, seen in loaded for layer in seen})
    top_k = len(next(iter(loaded[0][1].values()))[0])
    biggest = max(max(max(ids) for ids in toks) for _, per_layer, _, _ in loaded for toks in per_layer.values())
    header = TraceHeader(model=opts.model or "unknown", moe_layers=tuple(layers),
                         num_experts=opts.num_experts or biggest + 1, top_k=top_k,
                         expert_bytes=opts.expert_bytes or 0, source=f"expert-selection-json:{src}")
    missing = tokens = 0
    with TraceWriter(dst, header) as writer:
        for path, per_layer, prefill_t, _ in loaded:
            t = max(len(v) for v in per_layer.values())
            ids = np.full((t, len(layers), top_k), MISSING, np.int16)
            for l, layer in enumerate(layers):
                got = per_layer.get(layer, [])
                if any(len(x) != top_k for x in got):
                    raise TraceError(f"{path}: layer {layer} has tokens with other than {top_k} experts")
                ids[: len(got), l] = got
                missing += (t - len(got)) * top_k
            phase = np.full(t, DECODE, np.uint8)
            phase[:prefill_t] = PREFILL
            tokens += t
            writer.add(TraceRequest(ids_TLK=ids, phase_T=phase, name=path.stem))
    return ConvertSummary(len(loaded), tokens, missing, 0)


# -- OLMoE count pickles -> priors --------------------------------------------------------------------------
def _counts_matrix(path: Path, counters: Any, num_experts: int | None) -> np.ndarray:
    if not isinstance(counters, list) or not all(isinstance(c, collections.Counter) for c in counters):
        raise TraceError(f"{path}: expected a list of Counter(expert -> count), one per layer "
                         "(expert_counts*, not eid2token or crosslayer files)")
    if any(not isinstance(k, (int, np.integer)) for c in counters for k in c):
        raise TraceError(f"{path}: counter keys are not expert ids (a crosslayer file?)")
    e = num_experts or 1 + max(int(k) for c in counters for k in c)
    out = np.zeros((len(counters), e))
    for l, counter in enumerate(counters):
        for expert, count in counter.items():
            out[l, int(expert)] = count
    return out


def convert_olmoe_counts(src: Path, dst: Path, opts: ConvertOptions, progress: Progress) -> ConvertSummary:
    paths = _sources(src, r".*\.pkl")
    priors = {p.stem: _counts_matrix(p, load_counters(p), opts.num_experts) for p in progress(paths, len(paths))}
    shapes = {m.shape for m in priors.values()}
    if len(shapes) != 1:
        raise TraceError(f"{src}: the pickles disagree on layers x experts: {sorted(shapes)}")
    num_layers, num_experts = shapes.pop()
    layers = opts.layers or (0, 7, 15)
    if len(layers) != num_layers:
        raise TraceError(f"{src}: {num_layers} counters per file but --layers gives {len(layers)}")
    top_k = opts.top_k or _top_k_from_top1(src, paths, priors)
    model = opts.model or {"olmoe": "allenai/OLMoE-1B-7B-0924", "mistral": "mistralai/Mixtral-8x7B-v0.1"}.get(
        (src if src.is_dir() else src.parent).parent.name, "unknown")
    header = TraceHeader(model=model, moe_layers=tuple(layers), num_experts=num_experts, top_k=top_k,
                         expert_bytes=opts.expert_bytes or 0, source=f"olmoe-counts:{src}")
    with TraceWriter(dst, header) as writer:
        for name, counts in priors.items():
            writer.add_prior(name, counts)
    return ConvertSummary(0, 0, 0, len(priors))


def _top_k_from_top1(src: Path, paths: list[Path], priors: dict[str, np.ndarray]) -> int:
    """All-choice counts over first-choice counts is k: read the sibling `<dir>_top1` folder when present."""
    for path in paths:
        sibling = path.parent.with_name(path.parent.name + "_top1") / path.name
        if sibling.is_file():
            top1 = _counts_matrix(sibling, load_counters(sibling), priors[path.stem].shape[1])
            return int(round(priors[path.stem].sum() / max(top1.sum(), 1.0)))
    raise TraceError(f"{src}: cannot infer top-k (no sibling *_top1 folder); pass --top-k")


Converter = Callable[[Path, Path, ConvertOptions, Progress], ConvertSummary]
CONVERTERS: dict[str, Converter] = {
    "deepseek-csv": convert_deepseek_csv,
    "mixtral-jsonl": convert_mixtral_jsonl,
    "mixtral-raw": convert_mixtral_raw,
    "expert-selection-json": convert_expert_selection,
    "olmoe-counts": convert_olmoe_counts,
}


def convert(fmt: str, src: str | Path, dst: str | Path, opts: ConvertOptions = ConvertOptions(),
            progress: Progress = no_progress, replace: bool = False) -> ConvertSummary:
    """Convert `src` into a moepager trace at `dst` (an existing `dst` only with `replace`)."""
    if fmt not in CONVERTERS:
        raise TraceError(f"unknown trace format '{fmt}'; choose from {sorted(CONVERTERS)}")
    src, dst = Path(src), Path(dst)
    if dst.exists() and dst.resolve() == src.resolve():
        raise TraceError("the destination is the source; choose another file")
    check_file(dst, "destination", replace, {"SRC": src})
    with atomic_file(dst) as partial:
        try:
            return CONVERTERS[fmt](src, partial, opts, progress)
        except UnicodeDecodeError as e:
            raise TraceError(f"{src} is not a {fmt} trace: its bytes are not UTF-8 text ({e.reason} at byte "
                             f"{e.start})") from None
