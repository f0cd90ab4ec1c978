"""Reading Hugging Face checkpoints: config.json, single-file or sharded safetensors, per-tensor reads.

We parse the safetensors header ourselves (8-byte little-endian length, JSON header, raw data) so that every
tensor's file, byte offset and length is known without touching its data: a tensor is read (checkpoints/disk.py)
straight into the buffer that will hold it, and an expert can be read on its own (checkpoints/expert_reader.py
reads experts in place from these same locations). Truncated or corrupt files are reported by file and tensor.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from moepager.atomic_io import atomic_file
from moepager.checkpoints.disk import DiskFiles, Span
from moepager.errors import CheckpointError

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
}
SAFETENSORS_NAMES: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024
EXTERNAL = "moepager-external.json"
"""A checkpoint's tensors that live in another file, at byte offsets: {"file", "size", "mtime_ns", "tensors": {name:
{"offset", "dtype" (a safetensors dtype name), "shape"}}}. A GGUF conversion reads its float experts in place so
(checkpoints/gguf_read.py): the stacks are already one contiguous row per expert."""


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes live on disk."""

    path: Path
    offset: int
    """Absolute byte offset of the first element in `path`."""
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_safetensors_header(path: Path) -> dict[str, TensorLocation]:
    """Locations of every tensor in one safetensors file; raises CheckpointError if the file is malformed."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: corrupt safetensors file (shorter than its 8-byte header length)")
            header_len = int.from_bytes(prefix, "little")
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(f"{path}: corrupt safetensors file (header length {header_len} is invalid)")
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors file (header is not valid JSON)") from e
    data_start = 8 + header_len
    out: dict[str, TensorLocation] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {meta.get('dtype')}")
        begin, end = meta["data_offsets"]
        shape = tuple(meta["shape"])
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor '{name}' has {end - begin} bytes but shape {shape} needs "
                                  f"{numel * dtype.itemsize}")
        if data_start + end > size:
            raise CheckpointError(f"{path}: tensor '{name}' is truncated (file has {size} bytes, tensor ends at "
                                  f"{data_start + end})")
        out[name] = TensorLocation(path, data_start + begin, end - begin, dtype, shape)
    return out


class Checkpoint:
    """A Hugging Face checkpoint directory: its config.json and the locations of all its tensors."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise CheckpointError(f"model path '{self.path}' does not exist")
        if not self.path.is_dir():
            raise CheckpointError(f"model path '{self.path}' is not a directory (expected a checkpoint folder)")
        self.config = self._read_json("config.json", required=True)
        self.locations = self._index_tensors()
        self.files = DiskFiles("off")
        """Whole-tensor reads for the resident weights: through the page cache, whose pages are then dropped."""

    def _read_json(self, name: str, required: bool = False) -> dict[str, Any]:
        file = self.path / name
        if not file.exists():
            if required:
                raise CheckpointError(f"'{self.path}' has no {name}; is it a Hugging Face checkpoint?")
            return {}
        try:
            return json.loads(file.read_text(encoding="utf-8"))
        except OSError as e:
            raise CheckpointError(f"cannot read {file}: {e.strerror or e}") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file} is not valid JSON: {e}") from e

    def json(self, name: str) -> dict[str, Any]:
        """Another JSON file of the checkpoint (tokenizer_config.json, generation_config.json), {} if absent."""
        return self._read_json(name)

    def _index_tensors(self) -> dict[str, TensorLocation]:
        index = self._read_json("model.safetensors.index.json")
        if index:
            weight_map: Mapping[str, str] = index.get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"'{self.path}' has no *.safetensors weights")
        locations: dict[str, TensorLocation] = {}
        for name in files:
            file = self.path / name
            if not file.exists():
                raise CheckpointError(f"shard '{name}' listed in model.safetensors.index.json is missing")
            locations.update(read_safetensors_header(file))
        if index:
            missing = [t for t in weight_map if t not in locations]
            if missing:
                raise CheckpointError(f"tensor '{missing[0]}' is listed in the index but absent from its shard")
        return locations | self._external()

    def _external(self) -> dict[str, TensorLocation]:
        """The tensors EXTERNAL places in another file, checked against that file as it was when written."""
        spec = self._read_json(EXTERNAL)
        if not spec:
            return {}
        file = Path(spec["file"])
        try:
            st = file.stat()
        except OSError as e:
            raise CheckpointError(f"{self.path} reads tensors from {file}, which cannot be read: "
                                  f"{e.strerror or e}") from None
        if (st.st_size, st.st_mtime_ns) != (spec["size"], spec["mtime_ns"]):
            raise CheckpointError(f"{self.path} reads tensors from {file}, which has changed since "
                                  f"({spec['size']} -> {st.st_size} bytes); convert it again")
        out = {}
        for name, t in spec["tensors"].items():
            dtype, shape = SAFETENSORS_DTYPES[t["dtype"]], tuple(t["shape"])
            nbytes = dtype.itemsize * math.prod(shape)
            if t["offset"] + nbytes > st.st_size:
                raise CheckpointError(f"{file}: tensor '{name}' ends past the file's {st.st_size} bytes")
            out[name] = TensorLocation(file, t["offset"], nbytes, dtype, shape)
        return out

    def has(self, name: str) -> bool:
        return name in self.locations

    def location(self, name: str) -> TensorLocation:
        try:
            return self.locations[name]
        except KeyError:
            raise CheckpointError(f"tensor '{name}' is missing from the checkpoint at '{self.path}'") from None

    def read_exact_into(self, name: str, out: torch.Tensor) -> None:
        """Copy the whole tensor `name` into `out` (same shape), converting dtype if needed."""
        loc = self.location(name)
        if loc.shape != tuple(out.shape):
            raise CheckpointError(f"tensor '{name}' has shape {list(loc.shape)} but config.json implies "
                                  f"{list(out.shape)}")
        self._read_converting(loc, out)

    def _read_converting(self, loc: TensorLocation, out: torch.Tensor) -> None:
        if out.dtype == loc.dtype and out.is_contiguous() and out.device.type == "cpu":
            self.files.read([Span(loc.path, loc.offset, out.view(-1).view(torch.uint8))])
            return
        tmp = torch.empty(loc.shape, dtype=loc.dtype)
        self.files.read([Span(loc.path, loc.offset, tmp.view(-1).view(torch.uint8))])
        out.copy_(tmp.view(out.shape))


def load_module_weights(module: torch.nn.Module, checkpoint: Checkpoint, disk_name: Callable[[str], str],
                        progress: Callable[[int], None] | None = None) -> None:
    """Fill every parameter and persistent buffer of `module` from the checkpoint.

    `disk_name` maps a module name to the name stored on disk (the architectures whose Hub names differ from
    their module names supply it). Shapes are checked; a tied `lm_head.weight` is left to the caller.
    """
    with torch.no_grad():
        for name, tensor in module.state_dict(keep_vars=True).items():
            checkpoint.read_exact_into(disk_name(name), tensor.data)
            if progress is not None:
                progress(tensor.numel() * tensor.element_size())


def write_external(out_dir: Path, file: Path, tensors: dict[str, tuple[int, torch.dtype, tuple[int, ...]]]) -> None:
    """Record in `out_dir` that `tensors` (name -> offset, dtype, shape) are read from `file` in place (EXTERNAL)."""
    st = file.stat()
    spec = {"file": str(file.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "tensors": {n: {"offset": off, "dtype": SAFETENSORS_NAMES[dt], "shape": list(shape)}
                        for n, (off, dt, shape) in tensors.items()}}
    (out_dir / EXTERNAL).write_text(json.dumps(spec))


def write_safetensors(path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                      produce: Callable[[str], torch.Tensor], progress: Callable[[int], None] | None = None) -> None:
    """Write one safetensors file tensor by tensor (header first, then each `produce(name)` in order), so a
    file of many GB never needs its size in RAM. Written to a temporary name and renamed when complete."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, dtype, shape in entries:
            t = produce(name)
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"tensor '{name}' is {t.dtype} {list(t.shape)}, its header says {dtype} {list(shape)}")
            f.write(memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()))
            if progress is not None:
                progress(t.numel() * t.element_size())


def shard_names(count: int) -> list[str]:
    """Hub names of `count` safetensors shards."""
    return ["model.safetensors"] if count == 1 else \
        [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_index(out_dir: Path, names: list[str], shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]]) -> None:
    """model.safetensors.index.json for a sharded checkpoint (nothing for one file)."""
    if len(shards) < 2:
        return
    total = sum(d.itemsize * math.prod(s) for shard in shards for _, d, s in shard)
    weight_map = {t: n for n, shard in zip(names, shards) for t, _, _ in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def split_shards(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], shard_bytes: int
                 ) -> list[list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """Consecutive entries grouped into shards of at most `shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dtype, shape))
        size += nbytes
    return shards


def write_shards(out_dir: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 produce: Callable[[str], torch.Tensor], shard_bytes: int = 4 << 30, desc: str = "writing",
                 show_progress: bool = True, leave: bool = True) -> None:
    """A checkpoint's tensors under `out_dir`: safetensors shards of at most `shard_bytes` (and their index when
    there are several), each tensor made by `produce(name)` as it is written, with a progress bar of bytes."""
    shards = split_shards(entries, shard_bytes)
    names = shard_names(len(shards))
    total = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in entries)
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not show_progress, leave=leave) as bar:
        for name, shard in zip(names, shards):
            write_safetensors(out_dir / name, shard, produce, bar.update)
    write_index(out_dir, names, shards)
