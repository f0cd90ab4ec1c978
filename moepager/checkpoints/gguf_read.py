"""GGUF in: `--model FILE.gguf` loads a GGUF file of the architectures export-gguf writes (checkpoints/gguf_write.py),
converted once into a cached checkpoint directory, then loaded and paged like any other. Float experts
(BF16/F16/F32 stacks) are not copied: the conversion holds the dense tensors and the tokenizer, and points at each
expert's row of the GGUF stacks (checkpoints/safetensors.py EXTERNAL), which the expert store reads in place (O_DIRECT,
no page cache) as it reads a safetensors shard. A model too large for the disk twice runs from its one GGUF file.

Reading: BF16/F16/F32 tensors are taken as they are; Q4_0 experts become moepager int4 experts (groups of 32,
symmetric) without any rounding; Q8_0 experts become moepager int8 experts (one scale per output channel,
requantized from the exact Q8_0 values: a second rounding, of int8's size); Q8_0/Q4_0 dense tensors are
dequantized to bf16. Any other tensor type is refused with the list of supported ones.
deepseek2 files read back as DeepSeek-V3 when their gating function is sigmoid, DeepSeek-V2 otherwise; a split
attn_k_b / attn_v_b pair is joined back into kv_b_proj.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from moepager.atomic_io import atomic_dir, check_dir
from moepager.checkpoints.expert_reader import is_routed_expert
from moepager.checkpoints.gguf_write import (
    BLOCK,
    FLOAT_TYPES,
    HF_ARCHS,
    QWEN2_PRE,
    READ_PRES,
    READ_TYPES,
    expert_names,
    join_kv_b,
    name_map,
    q4_0_to_int4,
    q4_0_values,
    q8_0_values,
    unpermute,
)
from moepager.checkpoints.quantized import quantization_config
from moepager.checkpoints.safetensors import EXTERNAL, write_external, write_shards
from moepager.errors import CheckpointError
from moepager.experts.quant import QuantFormat, QuantizedProjection, projection_tensors, quantize_int8
from moepager.models.config import ModelConfig
from moepager.models.specs import spec_for


def gguf_cache_dir() -> Path:
    return Path(os.environ.get("MOEPAGER_CACHE", Path.home() / ".cache" / "moepager")) / "gguf"


TensorSpecs = Callable[[dict[str, Any]], list[tuple[str, tuple[int, ...]]]]
"""(HF name, shape) of every tensor a checkpoint of a config.json holds: the model code's list (models/registry.py
`tensor_specs`), which a GGUF file's conversion fills in; the formats sit below the model code, so it is handed in."""


def resolve_model_path(path: str | os.PathLike[str], tensor_specs: TensorSpecs) -> Path:
    """A checkpoint directory for `path`: itself, or for a .gguf file its converted checkpoint (made once)."""
    p = Path(path)
    if p.suffix.lower() == ".gguf" and p.is_file():
        return gguf_checkpoint(p, tensor_specs)
    if p.suffix.lower() == ".gguf" and not p.exists():
        raise CheckpointError(f"model path '{p}' does not exist")
    return p


SOURCE = "moepager-source.json"
"""What a cached conversion was made from (path, size, modification time): how stale ones are found."""


def gguf_checkpoint(path: Path, tensor_specs: TensorSpecs, show_progress: bool = True) -> Path:
    """The checkpoint directory a GGUF file converts to, under the cache (keyed by the file's path, size and
    modification time); converted now if it is not there yet. A new conversion first removes the cached ones whose
    GGUF file is gone or has changed since (they can never be used again), and says where it writes and how much."""
    st = path.stat()
    source = {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    key = hashlib.sha256(f"{source['path']}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = gguf_cache_dir() / f"{path.stem}-{key}"
    if (out / "config.json").exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot make the GGUF conversion cache {out.parent}: {e.strerror or e}; point "
                              "MOEPAGER_CACHE at a writable directory") from None
    check_dir(out, "the GGUF conversion cache", force=True)  # (writable: a probe file made and removed)
    freed = prune_gguf_cache()
    with atomic_dir(out, force=True) as tmp:
        _convert_gguf(path, tmp, tensor_specs, show_progress)
        (tmp / SOURCE).write_text(json.dumps(source))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    note = f"; removed {freed[0]} stale conversion(s), {freed[1] / 2**30:.2f} GiB" if freed[0] else ""
    in_place = ", its float experts read from the GGUF file in place" if (out / EXTERNAL).exists() else ""
    print(f"converted {path.name} once into {out} ({size / 2**30:.2f} GiB{in_place}; MOEPAGER_CACHE moves the cache"
          f"{note})", file=sys.stderr)
    return out


def prune_gguf_cache() -> tuple[int, int]:
    """Remove cached conversions whose GGUF file no longer exists or has changed; (how many, bytes freed)."""
    removed = freed = 0
    for entry in gguf_cache_dir().glob("*/" + SOURCE):
        try:
            source = json.loads(entry.read_text())
            st = os.stat(source["path"])
            current = (st.st_size, st.st_mtime_ns) == (source["size"], source["mtime_ns"])
        except (OSError, ValueError, KeyError):
            current = False
        if not current:
            freed += sum(f.stat().st_size for f in entry.parent.iterdir() if f.is_file())
            shutil.rmtree(entry.parent, ignore_errors=True)
            removed += 1
    return removed, freed


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _open(path: Path) -> Any:
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the reader raises many kinds on a short or garbled file
        raise CheckpointError(f"{path}: not a readable GGUF file (truncated or corrupt: {e})") from e


def _config_from_gguf(reader: Any, arch: str, vocab: int, tied: bool) -> dict[str, Any]:
    def kv(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        return float(str(np.float32(value))) if isinstance(value, float) else value  # 1e-06, not 9.99999997e-07

    hidden, heads = int(kv("embedding_length")), int(kv("attention.head_count"))
    config: dict[str, Any] = {
        "architectures": [HF_ARCHS[arch]], "vocab_size": vocab, "hidden_size": hidden,
        "num_hidden_layers": int(kv("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(kv("attention.head_count_kv", heads)),
        "max_position_embeddings": int(kv("context_length", 4096)),
        "rms_norm_eps": float(kv("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": {"rope_theta": float(kv("rope.freq_base", 10000.0)), "rope_type": "default"},
        "tie_word_embeddings": tied, "hidden_act": "silu", "num_experts_per_tok": int(kv("expert_used_count")),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
    }
    experts, ff = int(kv("expert_count")), int(kv("feed_forward_length", 0))
    expert_ff = int(kv("expert_feed_forward_length", ff))
    head_dim = int(kv("attention.key_length", hidden // heads))
    if arch == "llama":
        config |= {"model_type": "mixtral", "num_local_experts": experts, "intermediate_size": expert_ff,
                   "head_dim": head_dim}
    elif arch == "olmoe":
        config |= {"model_type": "olmoe", "num_experts": experts, "intermediate_size": expert_ff,
                   "norm_topk_prob": False}
    elif arch == "deepseek2":
        config |= _deepseek2_config(kv, heads, experts, ff, expert_ff)
    else:
        config |= {"model_type": "qwen3_moe" if arch == "qwen3moe" else "qwen2_moe", "num_experts": experts,
                   "moe_intermediate_size": expert_ff, "intermediate_size": ff or expert_ff,
                   "mlp_only_layers": [], "decoder_sparse_step": 1}
        if arch == "qwen3moe":
            config |= {"head_dim": head_dim, "norm_topk_prob": bool(kv("expert_weights_norm", True))}
        else:
            config |= {"shared_expert_intermediate_size": int(kv("expert_shared_feed_forward_length")),
                       "norm_topk_prob": False, "qkv_bias": True}
    return config


def _deepseek2_config(kv: Callable[..., Any], heads: int, experts: int, ff: int, expert_ff: int) -> dict[str, Any]:
    """A DeepSeek-V2 (softmax router) or V3 (sigmoid router) config from deepseek2 metadata (as
    `_deepseek2_metadata` and llama.cpp's converter write it; files without the MLA lengths hold per-head ones)."""
    v3 = int(kv("expert_gating_func", gguf.ExpertGatingFuncType.SOFTMAX)) == gguf.ExpertGatingFuncType.SIGMOID
    rope = int(kv("rope.dimension_count"))
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2", "num_key_value_heads": heads,
        "kv_lora_rank": int(kv("attention.kv_lora_rank")), "q_lora_rank": int(kv("attention.q_lora_rank", 0)) or None,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(kv("attention.key_length_mla", kv("attention.key_length"))) - rope,
        "v_head_dim": int(kv("attention.value_length_mla", kv("attention.value_length"))),
        "n_routed_experts": experts, "moe_intermediate_size": expert_ff, "intermediate_size": ff or expert_ff,
        "n_shared_experts": int(kv("expert_shared_count", 0)),
        "first_k_dense_replace": int(kv("leading_dense_block_count", 0)),
        "moe_layer_freq": 1, "routed_scaling_factor": float(kv("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(kv("expert_weights_norm", False)), "topk_method": "noaux_tc" if v3 else "greedy"}
    if v3:
        config |= {"scoring_func": "sigmoid", "rope_interleave": True, "n_group": int(kv("expert_group_count", 1)),
                   "topk_group": int(kv("expert_group_used_count", 1))}
    scaling = kv("rope.scaling.type", "none")
    if scaling == "yarn":
        mscale = float(kv("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1  # written as 0.1 * mscale_all_dim
        config["rope_parameters"] = {
            "rope_theta": float(kv("rope.freq_base", 10000.0)), "rope_type": "yarn",
            "factor": float(kv("rope.scaling.factor")),
            "original_max_position_embeddings": int(kv("rope.scaling.original_context_length")),
            "beta_fast": float(kv("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(kv("rope.scaling.yarn_beta_slow", 1.0)), "mscale": mscale, "mscale_all_dim": mscale}
    elif scaling != "none":
        raise CheckpointError(f"GGUF deepseek2 rope scaling '{scaling}' is not supported "
                              "(moepager reads none and yarn)")
    return config


def _tokenizer_from_gguf(reader: Any, out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise CheckpointError(f"GGUF tokenizer model '{_field(reader, 'tokenizer.ggml.model')}' is not supported "
                              "(moepager reads byte-level BPE, `gpt2`)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges))
    pre = _field(reader, "tokenizer.ggml.pre")
    if pre not in READ_PRES:
        raise CheckpointError(f"GGUF pre-tokenizer '{pre}' is not supported; moepager reads {', '.join(READ_PRES)}")
    if pre == "qwen2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PRE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = sorted((i, t) for i, t in enumerate(tokens) if types[i] == 3)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in specials])
    for i, t in specials:
        if tok.token_to_id(t) != i:
            raise CheckpointError(f"GGUF special token {t!r} has id {i}, which its vocabulary cannot keep")
    tok.save(str(out / "tokenizer.json"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    tcfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                            "eos_token": tokens[eos] if eos is not None else None}
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tcfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))


def _convert_gguf(path: Path, out: Path, tensor_specs: TensorSpecs, show_progress: bool) -> None:
    reader = _open(path)
    arch = _field(reader, "general.architecture")
    if arch not in HF_ARCHS:
        raise CheckpointError(f"GGUF architecture '{arch}' is not supported; moepager reads "
                              f"{', '.join(sorted(HF_ARCHS))}")
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(READ_TYPES))
    if bad:
        raise CheckpointError(f"{path}: tensor types {', '.join(bad)} are not supported; moepager reads "
                              f"{', '.join(READ_TYPES)}")
    tensors = GGUFTensors(path, reader)
    config = _config_from_gguf(reader, arch, int(tensors.meta["token_embd.weight"].shape[-1]),
                               "output.weight" not in tensors.meta)
    cfg = spec_for(config).parse_config(config)
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    produce: dict[str, Callable[[], torch.Tensor]] = {}
    _dense_entries(tensors, arch, config, cfg, tensor_specs(config), entries, produce)
    in_place: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {}
    fmt = _expert_entries(tensors, cfg, entries, produce, in_place)
    write_shards(out, entries, lambda name: produce[name](), desc=f"converting {path.name}",
                 show_progress=show_progress, leave=False)
    if in_place:
        write_external(out, path, in_place)
    _tokenizer_from_gguf(reader, out)
    config["dtype"] = str(tensors.float_dtype).removeprefix("torch.")
    if fmt is not None:
        config["quantization_config"] = quantization_config(fmt)
    config["converted_from"] = str(path.resolve())
    (out / "config.json").write_text(json.dumps(config, indent=2))


class GGUFTensors:
    """A GGUF file's tensors as torch tensors in HF shapes, the last one converted kept (an expert stack is
    asked for expert by expert)."""

    def __init__(self, path: Path, reader: Any):
        self.path, self.meta = path, {t.name: t for t in reader.tensors}
        floats = [t.tensor_type.name for t in reader.tensors
                  if t.tensor_type.name in ("BF16", "F16") and not t.name.endswith("_exps.weight")]
        self.float_dtype = torch.float16 if floats[:1] == ["F16"] else torch.bfloat16
        """The dtype dequantized tensors are written in: the file's first 16-bit dense tensor's, else bf16."""
        self._last: tuple[str, torch.Tensor] | None = None

    def kind(self, gname: str) -> str:
        if gname not in self.meta:
            raise CheckpointError(f"{self.path}: tensor '{gname}' is missing")
        return self.meta[gname].tensor_type.name

    def raw(self, gname: str) -> torch.Tensor:
        """The tensor's bytes, copied (the reader's arrays are read-only memory maps)."""
        self.kind(gname)
        return torch.from_numpy(np.array(self.meta[gname].data)).view(torch.uint8)

    def floats(self, gname: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor in `shape`, as stored when it is F32/F16/BF16, dequantized to `float_dtype` otherwise."""
        if self._last is not None and self._last[0] == gname:
            return self._last[1]
        kind, data = self.kind(gname), self.raw(gname)
        n, k = int(np.prod(shape[:-1])), shape[-1]
        if kind in FLOAT_TYPES:
            t = data.view(FLOAT_TYPES[kind])
        else:
            t = (q8_0_values if kind == "Q8_0" else q4_0_values)(data, n, k).to(self.float_dtype)
        if t.numel() != n * k:
            raise CheckpointError(f"{self.path}: tensor '{gname}' has {t.numel()} elements, the config implies "
                                  f"{shape}")
        self._last = (gname, t.reshape(shape))
        return self._last[1]


def _dense_entries(tensors: GGUFTensors, arch: str, config: dict[str, Any], cfg: ModelConfig,
                   specs: list[tuple[str, tuple[int, ...]]], entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                   produce: dict[str, Callable[[], torch.Tensor]]) -> None:
    """Every tensor but the routed experts, under its HF name (llama's q/k rows unpermuted)."""
    mapped = name_map(arch, config["num_hidden_layers"])
    for hf_name, shape in specs:
        if is_routed_expert(hf_name):
            continue
        gname = mapped(hf_name)
        if gname not in tensors.meta and hf_name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue
        if arch == "deepseek2" and hf_name.endswith("kv_b_proj.weight") and gname not in tensors.meta:
            entries.append((hf_name, _kv_b_entry(tensors, gname, config, produce, hf_name), tuple(shape)))
            continue
        kind = tensors.kind(gname)

        def dense(gname: str = gname, shape: tuple[int, ...] = tuple(shape), hf_name: str = hf_name) -> torch.Tensor:
            t = tensors.floats(gname, shape)
            if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                t = unpermute(t, cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads)
            return t.contiguous()
        entries.append((hf_name, FLOAT_TYPES.get(kind, tensors.float_dtype), tuple(shape)))
        produce[hf_name] = dense


def _kv_b_entry(tensors: GGUFTensors, kv_b_name: str, config: dict[str, Any],
                produce: dict[str, Callable[[], torch.Tensor]], hf_name: str) -> torch.dtype:
    """kv_b_proj rebuilt from the split attn_k_b / attn_v_b of an MLA file; returns the dtype it is written in."""
    h, r = config["num_attention_heads"], config["kv_lora_rank"]
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    k_name, v_name = kv_b_name.replace("attn_kv_b", "attn_k_b"), kv_b_name.replace("attn_kv_b", "attn_v_b")
    kinds = {tensors.kind(k_name), tensors.kind(v_name)}
    dtype = FLOAT_TYPES[next(iter(kinds))] if len(kinds) == 1 and kinds <= set(FLOAT_TYPES) else tensors.float_dtype
    produce[hf_name] = lambda: join_kv_b(tensors.floats(k_name, (h, r, nope)),
                                          tensors.floats(v_name, (h, v, r))).to(dtype).contiguous()
    return dtype


def _expert_entries(tensors: GGUFTensors, cfg: ModelConfig, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                    produce: dict[str, Callable[[], torch.Tensor]],
                    in_place: dict[str, tuple[int, torch.dtype, tuple[int, ...]]]) -> QuantFormat | None:
    """Every routed expert's tensors under the architecture's per-expert names; returns the quantized format
    they take (all Q4_0: int4; all Q8_0: int8; otherwise float). A float stack's experts go to `in_place` (name ->
    offset in the GGUF file, dtype, shape) instead of `entries`: its row e is expert e's matrix, as stored."""
    kinds = {tensors.kind(n) for layer in cfg.moe_layers for n in expert_names(layer)}
    fmt = QuantFormat(4, BLOCK) if kinds == {"Q4_0"} else QuantFormat(8) if kinds == {"Q8_0"} else None
    d, f, count = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    converted: dict[str, list[QuantizedProjection]] = {}  # the last stack's experts in our format

    def projection(gname: str, e: int, n: int, k: int) -> QuantizedProjection:
        if gname not in converted:
            converted.clear()
            per = tensors.raw(gname).reshape(count, -1)
            converted[gname] = [q4_0_to_int4(per[i], n, k) if fmt.bits == 4
                                else QuantizedProjection(*quantize_int8(q8_0_values(per[i], n, k), torch.float16))
                                for i in range(count)]
        return converted[gname][e]

    naming = spec_for(cfg.raw).expert_naming
    for layer in cfg.moe_layers:  # stack by stack, so that each stack is read and converted once
        for template, gname, (n, k) in zip((naming.gate, naming.up, naming.down), expert_names(layer),
                                           ((f, d), (f, d), (d, f))):
            for e in range(count):
                name = template.format(layer=layer, expert=e)
                kind = tensors.kind(gname)
                if kind in FLOAT_TYPES:
                    meta, dtype = tensors.meta[gname], FLOAT_TYPES[kind]
                    if int(meta.n_elements) != count * n * k:
                        raise CheckpointError(f"{tensors.path}: tensor '{gname}' has {int(meta.n_elements)} elements, "
                                              f"the config implies {[count, n, k]}")
                    in_place[name] = (int(meta.data_offset) + e * n * k * dtype.itemsize, dtype, (n, k))
                    continue
                if fmt is None:
                    entries.append((name, tensors.float_dtype, (n, k)))
                    produce[name] = (lambda gname=gname, e=e, n=n, k=k:
                                     tensors.floats(gname, (count, n, k))[e].contiguous())
                    continue
                for suffix, dt, shp in projection_tensors(fmt, n, k, torch.float16):
                    entries.append((name + suffix, dt, shp))
                    produce[name + suffix] = (lambda gname=gname, e=e, n=n, k=k, suffix=suffix:
                                              projection(gname, e, n, k).tensor(suffix).contiguous())
    return fmt
