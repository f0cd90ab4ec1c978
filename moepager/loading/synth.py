"""`make-model`: random-weight Hugging Face checkpoints at real geometry, streamed to disk.

Tensors are generated and written one at a time (header first, then data), so a multi-GB model never needs
its size in RAM. Names and shapes come from our own model code (built on the meta device) plus the
architecture's per-expert naming (models/registry.py `tensor_specs`), so what we write is exactly what we (and
transformers) load. The tokenizer is a byte-level BPE trained on a small built-in text and extended with synthetic
merges up to the configured vocabulary, so every token id decodes to text.

An `--out` ending in .gguf is written as a GGUF file instead (bf16 or f16, as llama.cpp and `moepager --model
FILE.gguf` read it): the same tensors, drawn in the same order, go straight to checkpoints/gguf_write.py, so a model
bigger than the disk could hold twice (a checkpoint and its export) is made once, for both engines.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from moepager.atomic_io import atomic_dir, check_dir, check_file, check_space
from moepager.checkpoints.dtypes import DTYPES
from moepager.checkpoints.expert_reader import is_routed_expert
from moepager.checkpoints.gguf_write import ExportSource, gguf_bytes, write_gguf
from moepager.checkpoints.safetensors import write_shards
from moepager.errors import MoepagerError
from moepager.loading.synth_presets import PRESETS, preset_config
from moepager.models.registry import tensor_specs
from moepager.models.specs import spec_for

INIT_STD = 0.02
OWN_GENERATOR_NUMEL = 1 << 20
"""Tensors of this many elements or more are drawn from generators of their own, in parallel (tensor i of a
checkpoint made with seed s from one seeded s * TENSOR_SEEDS + i + 1); smaller ones from the seed's one generator,
in order (so small checkpoints, the tests' included, are what they always were)."""
TENSOR_SEEDS = 1_000_003
MAX_SEED = 2**44
"""Seeds below this keep every tensor's seed (seed * TENSOR_SEEDS + i + 1) within torch's 64-bit generator seeds."""
GENERATORS = 8
"""Most threads drawing tensors ahead of the writer (each holds at most one tensor); fewer on fewer CPUs."""
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def checkpoint_bytes(config: dict[str, Any], dtype: torch.dtype) -> int:
    """Bytes of the tensors a checkpoint of this config holds in `dtype` (what make-model will write). Past 64 layers
    the last layer's bytes are counted once per further layer (listing a 100,000-layer model's tensors would take
    longer than refusing it should)."""
    def of(layers: int) -> int:
        return sum(math.prod(shape) for _, shape in tensor_specs({**config, "num_hidden_layers": layers}))

    layers = int(config["num_hidden_layers"])
    if layers <= 64:
        return of(layers) * dtype.itemsize
    last = of(64) - of(63)
    return (of(64) + (layers - 64) * last) * dtype.itemsize


def _random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=torch.float32 if "correction" in name else dtype)
    return (torch.randn(shape, generator=gen) * INIT_STD).to(dtype)


def write_tokenizer(out: Path, vocab_size: int) -> int:
    """Train a byte-level BPE on the built-in text, pad it to `vocab_size` with synthetic merges; returns
    the id of <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = resources.files("moepager").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 1024), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus.splitlines(), trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list = data["model"]["merges"]
    if len(vocab) > vocab_size:
        raise MoepagerError(f"vocab_size {vocab_size} is below the tokenizer's minimum of {len(vocab)}")
    for a, b in _synthetic_pairs(sorted((t for t in vocab if t not in SPECIAL_TOKENS), key=vocab.get)):
        if len(vocab) >= vocab_size:
            break
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append([a, b] if merges and isinstance(merges[0], list) else f"{a} {b}")
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 1 << 20}, indent=2))
    return vocab["<|endoftext|>"]


def _synthetic_pairs(tokens: list[str]) -> Iterator[tuple[str, str]]:
    for a in tokens[256:] or tokens:
        for b in tokens:
            yield a, b


def make_model(out: str | os.PathLike[str], preset: str, arch: str | None = None, layers: int | None = None,
               dtype: str = "bfloat16", seed: int = 0, shard_bytes: int = 4 << 30, show_progress: bool = True,
               force: bool = False) -> Path:
    """Write a random-weight checkpoint of `preset` to `out`; returns the directory.

    `out` must not exist or be empty unless `force` (then it is replaced, old shards and index included). The
    checkpoint is written into a temporary sibling directory and renamed into place when complete, so an
    interrupted run leaves no half-written checkpoint (and no stray shards) under `out`."""
    config = preset_config(preset, arch, layers)
    if dtype not in DTYPES:
        raise MoepagerError(f"unknown dtype '{dtype}'; choose from {', '.join(DTYPES)}")
    if not 0 <= seed < MAX_SEED:
        raise MoepagerError(f"--seed must be an integer in [0, {MAX_SEED}), got {seed}")
    if Path(out).suffix.lower() == ".gguf":
        return _make_gguf(Path(out), preset, config, DTYPES[dtype], seed, show_progress, force)
    out_dir = check_dir(out, "--out", force)
    check_space(out_dir.parent, checkpoint_bytes(config, DTYPES[dtype]), "make-model --out")
    with atomic_dir(out_dir, force) as tmp:
        _write_checkpoint(tmp, config, DTYPES[dtype], seed, shard_bytes, f"writing {preset}", show_progress)
    return out_dir


GGUF_TYPES = {torch.bfloat16: "bf16", torch.float16: "f16"}


def _drawing_threads() -> int:
    return max(1, min(GENERATORS, os.cpu_count() or 1))


def _make_gguf(out: Path, preset: str, config: dict[str, Any], torch_dtype: torch.dtype, seed: int,
               show_progress: bool, force: bool) -> Path:
    """`make_model` to a GGUF file: the checkpoint's tensors, drawn as `_write_checkpoint` draws them, written
    through gguf_write's streaming writer (its tokenizer files made in a temporary folder the writer reads)."""
    if torch_dtype not in GGUF_TYPES:
        raise MoepagerError("make-model writes a GGUF file in bfloat16 or float16; --dtype float32 needs a checkpoint "
                            "directory")
    out_path = check_file(out, "--out", replace=force)
    assert out_path is not None
    with tempfile.TemporaryDirectory(prefix="moepager-make-") as folder:
        entries, produce = _tensors(Path(folder), config, torch_dtype, seed)
        with ThreadPoolExecutor(_drawing_threads()) as pool:
            make = produce(pool)
            naming = spec_for(config).expert_naming

            def expert(layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
                gate, up = (make(t.format(layer=layer, expert=e)) for t in (naming.gate, naming.up))
                return torch.cat((gate, up)), make(naming.down.format(layer=layer, expert=e))
            source = ExportSource(preset, config, Path(folder), {n: (dt, shape) for n, dt, shape in entries
                                                                 if not is_routed_expert(n)}, make, expert,
                                  torch_dtype)
            check_space(out_path.parent, gguf_bytes(source, GGUF_TYPES[torch_dtype]), "make-model --out")
            write_gguf(source, out_path, GGUF_TYPES[torch_dtype], show_progress=show_progress)
    return out_path


def _tensors(out_dir: Path, config: dict[str, Any], torch_dtype: torch.dtype, seed: int
             ) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]],
                        Callable[[ThreadPoolExecutor], Callable[[str], torch.Tensor]]]:
    """The tokenizer written to `out_dir`, `config` completed, and the checkpoint's entries with the maker of their
    tensors on a pool (asked for in the entries' order: checkpoints/safetensors.py's writer and gguf_write's alike)."""
    config["eos_token_id"] = write_tokenizer(out_dir, config["vocab_size"])
    config["dtype"] = str(torch_dtype).removeprefix("torch.")
    entries = [(name, torch.float32 if "correction_bias" in name else torch_dtype, shape)
               for name, shape in tensor_specs(config)]
    gen = torch.Generator().manual_seed(seed)
    large = [math.prod(shape) >= OWN_GENERATOR_NUMEL for _, _, shape in entries]

    def make(i: int) -> torch.Tensor:  # a large tensor from its own generator: the same bytes on any thread
        name, dt, shape = entries[i]
        return _random_tensor(name, shape, dt, torch.Generator().manual_seed(seed * TENSOR_SEEDS + i + 1)
                              if large[i] else gen)
    return entries, lambda pool: _ahead(pool, _drawing_threads(), [name for name, _, _ in entries], large, make)


def _write_checkpoint(out_dir: Path, config: dict[str, Any], torch_dtype: torch.dtype, seed: int, shard_bytes: int,
                      desc: str, show_progress: bool) -> None:
    entries, produce = _tensors(out_dir, config, torch_dtype, seed)
    with ThreadPoolExecutor(_drawing_threads()) as pool:
        write_shards(out_dir, entries, produce(pool), shard_bytes, desc, show_progress)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def _ahead(pool: ThreadPoolExecutor, depth: int, names: list[str], ahead: list[bool],
           make: Callable[[int], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """`produce(name)` for tensors asked for in `names`' order: those marked `ahead` made on the pool (at most
    `depth` beyond the one asked for) while earlier ones are written, the others when asked, in order (they share
    one generator). Normal samples are one thread's work per generator, the slow part of a large geometry's layer."""
    index = {name: i for i, name in enumerate(names)}
    futures: dict[int, Future[torch.Tensor]] = {}
    submitted = 0

    def produce(name: str) -> torch.Tensor:
        nonlocal submitted
        want = index[name]
        while submitted < len(names) and submitted <= want + depth:
            if ahead[submitted]:
                futures[submitted] = pool.submit(make, submitted)
            submitted += 1
        return futures.pop(want).result() if want in futures else make(want)
    return produce


__all__ = ["PRESETS", "make_model", "tensor_specs", "write_tokenizer"]
