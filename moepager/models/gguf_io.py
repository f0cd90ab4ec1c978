"""GGUF in and out: `moepager export-gguf` writes a checkpoint as a GGUF file llama.cpp runs, and
`--model FILE.gguf` loads one (converted once into a cached checkpoint directory, then loaded and paged like
any other).

Architectures (Hugging Face -> GGUF): Qwen3-MoE -> qwen3moe, Qwen2-MoE -> qwen2moe, OLMoE -> olmoe, Mixtral ->
llama (with llama.cpp's query/key row permutation for its rotary layout). Tensor names come from the `gguf`
package's own name map; metadata keys and the choice of F32 for norms, biases and routers follow llama.cpp's
convert_hf_to_gguf.py, read to learn the format. Experts are written as three stacked tensors per layer
(ffn_gate_exps, ffn_up_exps [E, F, D], ffn_down_exps [E, D, F]).

Types: `--type bf16|f16` converts every matrix; `q8_0|q4_0` quantize the routed experts (what moepager's
`--expert-dtype int8|int4` quantize) and keep every other tensor in the checkpoint's dtype. Blocks of 32 along
the input dimension with an fp16 scale d each (ggml's block_q8_0 / block_q4_0): Q8_0 q = round(x / d),
d = absmax / 127; Q4_0 w = (q - 8) * d, d = m / -8 with m the block's value of largest magnitude, the block's
16 bytes holding elements j (low nibble) and j + 16 (high nibble). Our quantizers choose the integers against the
fp16-rounded scale (experts/quant.py), so a Q4_0 file read back is exactly moepager's int4 (groups of 32,
symmetric) with those scales.

Reading: BF16/F16/F32 tensors are taken as they are; Q4_0 experts become moepager int4 experts (groups of 32,
symmetric) without any rounding; Q8_0 experts become moepager int8 experts (one scale per output channel,
requantized from the exact Q8_0 values: a second rounding, of int8's size); Q8_0/Q4_0 dense tensors are
dequantized to bf16. Any other tensor type is refused with the list of supported ones.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moepager.errors import CheckpointError, ConfigError
from moepager.experts.quant import (QuantFormat, QuantizedProjection, dequantize_int4, pack_nibbles,
                                    projection_tensors, quantize_int4, quantize_int8, unpack_nibbles)
from moepager.experts.weights import ExpertShape, ExpertWeights
from moepager.models.config import ModelConfig
from moepager.models.expert_reader import ExpertReader, is_routed_expert
from moepager.models.loader import Checkpoint, write_shards
from moepager.outputs import atomic_dir, atomic_file
from moepager.models.registry import architecture_for

GGUF_ARCHS = {"Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe", "OlmoeForCausalLM": "olmoe",
              "MixtralForCausalLM": "llama"}
HF_ARCHS = {v: k for k, v in GGUF_ARCHS.items()}
EXPORT_TYPES = ("bf16", "f16", "q8_0", "q4_0")
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
F32_TENSORS = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
"""Written in F32 whatever the type, as llama.cpp's converter does (norms and routers; 1-D tensors too)."""
BLOCK = 32
QWEN2_PRE = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
             "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
"""Qwen2's pre-tokenizer split (the GGUF pre type `qwen2`)."""


def _gguf():
    try:
        import gguf
    except ImportError as e:  # a dependency; say so if an install lacks it
        raise ConfigError("GGUF needs the `gguf` package (pip install gguf)") from e
    return gguf


# ---- ggml blocks ------------------------------------------------------------------------------------------


def q8_0_blocks(w_NK: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> [N, K/32 * 34] bytes of block_q8_0 (fp16 d, 32 int8)."""
    n, k = w_NK.shape
    blocks = w_NK.float().reshape(-1, BLOCK)
    q, d = quantize_int8(blocks, torch.float16)  # per block: d = absmax / 127 (rounded up to fp16), q = round(x / d)
    out = torch.cat((d.view(torch.uint8).reshape(-1, 2), q.view(torch.uint8)), 1)
    return out.reshape(n, k // BLOCK * 34)


def q4_0_blocks(w_NK: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> [N, K/32 * 18] bytes of block_q4_0 (fp16 d, 16 bytes: element j low, j + 16 high)."""
    n, k = w_NK.shape
    q, d, _ = quantize_int4(w_NK.float().reshape(-1, BLOCK), BLOCK, False, torch.float16)
    qs = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat((d.reshape(-1).view(torch.uint8).reshape(-1, 2), qs), 1).reshape(n, k // BLOCK * 18)


def q4_0_to_int4(raw: torch.Tensor, n: int, k: int) -> QuantizedProjection:
    """block_q4_0 bytes of an [N, K] matrix -> moepager int4 (plain nibbles, fp16 scales [N, K/32])."""
    b = raw.reshape(-1, 18)
    d = b[:, :2].contiguous().view(torch.float16).reshape(n, k // BLOCK)
    qs = b[:, 2:]
    q = torch.cat((qs & 15, qs >> 4), 1).reshape(n, k)
    return QuantizedProjection(pack_nibbles(q), d)


def q8_0_values(raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """block_q8_0 bytes -> the exact fp32 values q * d of an [N, K] matrix."""
    b = raw.reshape(-1, 34)
    d = b[:, :2].contiguous().view(torch.float16).float()
    return (b[:, 2:].contiguous().view(torch.int8).float() * d).reshape(n, k)


def q4_0_values(raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """block_q4_0 bytes -> the exact fp32 values (q - 8) * d of an [N, K] matrix."""
    p = q4_0_to_int4(raw, n, k)
    return dequantize_int4(unpack_nibbles(p.q), p.scale, torch.zeros_like(p.scale))


# ---- names --------------------------------------------------------------------------------------------------


def _name_map(arch: str, blocks: int) -> Callable[[str], str | None]:
    gguf = _gguf()
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    tmap = gguf.get_tensor_name_map(model_arch, blocks)
    return lambda name: tmap.get_name(name, try_suffixes=(".weight", ".bias"))


def _expert_names(layer: int) -> tuple[str, str, str]:
    return f"blk.{layer}.ffn_gate_exps.weight", f"blk.{layer}.ffn_up_exps.weight", f"blk.{layer}.ffn_down_exps.weight"


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's llama-arch rotary layout: each head's rows reordered from [half, half] to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- export -------------------------------------------------------------------------------------------------


def _tokenizer_metadata(writer: Any, directory: Path, config: dict[str, Any]) -> None:
    path = directory / "tokenizer.json"
    if not path.exists():
        raise ConfigError(f"{directory} has no tokenizer.json; export-gguf includes the tokenizer")
    tok = json.loads(path.read_text(encoding="utf-8"))
    model = tok.get("model", {})
    pre = tok.get("pre_tokenizer") or {}
    byte_level = any(p.get("type") == "ByteLevel" for p in [pre, *pre.get("pretokenizers", [])])
    if model.get("type") != "BPE" or not byte_level or model.get("byte_fallback"):
        raise ConfigError("export-gguf writes byte-level BPE tokenizers (GPT-2 style: Qwen, OLMoE, moepager's own); "
                          "this tokenizer is not one (SentencePiece-style tokenizers are not supported yet)")
    vocab: dict[str, int] = dict(model["vocab"])
    special = set()
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    size = max(config["vocab_size"], max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size  # UNUSED until filled
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = 3 if i in special else 1  # CONTROL or NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    split = json.dumps(pre)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if "\\\\p{L}+|\\\\p{N}|" in split else "gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos is not None:
        writer.add_eos_token_id(int(eos))
    if config.get("bos_token_id") is not None:
        writer.add_bos_token_id(int(config["bos_token_id"]))
    writer.add_add_bos_token(False)
    tcfg_path = directory / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text(encoding="utf-8")) if tcfg_path.exists() else {}
    template = tcfg.get("chat_template")
    if template is None and (directory / "chat_template.jinja").exists():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, str):
        writer.add_chat_template(template)


def export_gguf(model: str | os.PathLike[str], out: str | os.PathLike[str], type_: str = "bf16",
                show_progress: bool = True) -> Path:
    """Write checkpoint `model` as a GGUF file of `type_` (bf16, f16, q8_0, q4_0) to `out` (atomically)."""
    gguf = _gguf()
    from moepager.models.load import checkpoint_dtype

    if type_ not in EXPORT_TYPES:
        raise ConfigError(f"unknown --type '{type_}'; choose from {', '.join(EXPORT_TYPES)}")
    checkpoint = Checkpoint(model)
    cfg = _exportable(checkpoint)
    out_path = Path(out)
    if out_path.is_dir():
        raise ConfigError(f"--out {out_path} is a directory; give a file name such as model.gguf")
    if not out_path.parent.is_dir():
        raise ConfigError(f"--out: {out_path.parent} does not exist")
    dtype = checkpoint_dtype(checkpoint)
    float_type = {"f16": torch.float16, "bf16": torch.bfloat16}.get(type_, dtype)
    float_type = torch.bfloat16 if float_type == torch.float32 else float_type
    name = GGUF_ARCHS[cfg.architecture]
    with atomic_file(out_path) as tmp:
        writer = gguf.GGUFWriter(tmp, name)
        _write_metadata(writer, name, cfg, checkpoint, type_)
        _add_dense(writer, name, cfg, checkpoint, float_type)
        _add_experts(writer, cfg, checkpoint, ExpertShape(cfg.hidden_size, cfg.expert_intermediate_size, dtype),
                     type_, float_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=show_progress)
        writer.close()
    checkpoint.files.close()
    return out_path


def _exportable(checkpoint: Checkpoint) -> ModelConfig:
    """The checkpoint's parsed config, or the reason llama.cpp's architectures cannot take it."""
    from moepager.models.quantized import stored_format

    config = checkpoint.config
    hf_arch = config.get("architectures", ["?"])[0]
    if hf_arch not in GGUF_ARCHS:
        raise ConfigError(f"export-gguf supports {', '.join(sorted(GGUF_ARCHS))}, not {hf_arch}")
    if stored_format(config) is not None:
        raise ConfigError(f"{checkpoint.path} is a moepager-quantized checkpoint; export its float original")
    cfg = architecture_for(config).parse_config(config)
    if tuple(cfg.moe_layers) != tuple(range(cfg.num_layers)):
        raise ConfigError("export-gguf needs every layer to be a MoE layer (llama.cpp's qwen2moe/qwen3moe have no "
                          f"dense layers); this model's MoE layers are {list(cfg.moe_layers)}")
    rope = config.get("rope_parameters") or {}
    if (rope.get("rope_type") or "default") != "default" or config.get("rope_scaling"):
        raise ConfigError("export-gguf writes the default rotary embedding only; this model scales it")
    return cfg


def _write_metadata(writer: Any, name: str, cfg: ModelConfig, checkpoint: Checkpoint, type_: str) -> None:
    gguf = _gguf()
    config = checkpoint.config
    writer.add_name(checkpoint.path.name)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(int(config.get("intermediate_size", cfg.expert_intermediate_size)))
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(float(cfg.rope.theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.top_k)
    writer.add_expert_feed_forward_length(cfg.expert_intermediate_size)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    if name == "llama":
        writer.add_rope_dimension_count(cfg.head_dim)
        writer.add_vocab_size(cfg.vocab_size)
    if name == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    if name == "qwen3moe":
        writer.add_expert_weights_norm(bool(config.get("norm_topk_prob", False)))
    writer.add_file_type({"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[type_])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer_metadata(writer, checkpoint.path, config)


def _add_dense(writer: Any, name: str, cfg: ModelConfig, checkpoint: Checkpoint, float_type: torch.dtype) -> None:
    """Every tensor but the routed experts, under its GGUF name (norms and routers in F32)."""
    mapped = _name_map(name, cfg.num_layers)
    for hf_name, loc in checkpoint.locations.items():
        if is_routed_expert(hf_name):
            continue
        gname = mapped(hf_name)
        if gname is None:
            raise ConfigError(f"tensor '{hf_name}' has no GGUF name for {name}")
        t = torch.empty(loc.shape, dtype=loc.dtype)
        checkpoint.read_exact_into(hf_name, t)
        if name == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads)
        _add(writer, gname, t, torch.float32 if t.dim() <= 1 or gname.endswith(F32_TENSORS) else float_type)


def _add_experts(writer: Any, cfg: ModelConfig, checkpoint: Checkpoint, shape: ExpertShape, type_: str,
                 float_type: torch.dtype) -> None:
    """Each MoE layer's experts as three stacked tensors, in `float_type` or quantized to Q8_0/Q4_0."""
    gguf = _gguf()
    naming = architecture_for(checkpoint.config).expert_naming
    reader = ExpertReader(checkpoint, naming, shape, cfg.moe_layers[0], "off")
    d, f, e_count = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    scratch = ExpertWeights.empty(shape)
    for layer in cfg.moe_layers:
        gate = torch.empty(e_count, f, d, dtype=shape.dtype)
        up = torch.empty(e_count, f, d, dtype=shape.dtype)
        down = torch.empty(e_count, d, f, dtype=shape.dtype)
        for e in range(e_count):
            reader.read((layer, e), scratch.buffer)
            gate[e], up[e], down[e] = scratch.gate_up_2FD[:f], scratch.gate_up_2FD[f:], scratch.down_DF
        for gname, t in zip(_expert_names(layer), (gate, up, down)):
            if type_ in ("q8_0", "q4_0"):
                blocks = (q8_0_blocks if type_ == "q8_0" else q4_0_blocks)(t.reshape(-1, t.shape[-1]))
                qtype = gguf.GGMLQuantizationType.Q8_0 if type_ == "q8_0" else gguf.GGMLQuantizationType.Q4_0
                writer.add_tensor(gname, blocks.reshape(*t.shape[:-1], -1).numpy(), raw_dtype=qtype)
            else:
                _add(writer, gname, t, float_type)


def _add(writer: Any, name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    gguf = _gguf()
    t = t.to(dtype).contiguous()
    if dtype == torch.bfloat16:
        writer.add_tensor(name, t.view(torch.int16).numpy().view(np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        writer.add_tensor(name, t.numpy())


# ---- import -------------------------------------------------------------------------------------------------


def gguf_cache_dir() -> Path:
    return Path(os.environ.get("MOEPAGER_CACHE", Path.home() / ".cache" / "moepager")) / "gguf"


def resolve_model_path(path: str | os.PathLike[str]) -> Path:
    """A checkpoint directory for `path`: itself, or for a .gguf file its converted checkpoint (made once)."""
    p = Path(path)
    if p.suffix.lower() == ".gguf" and p.is_file():
        return gguf_checkpoint(p)
    if p.suffix.lower() == ".gguf" and not p.exists():
        raise CheckpointError(f"model path '{p}' does not exist")
    return p


def gguf_checkpoint(path: Path, show_progress: bool = True) -> Path:
    """The checkpoint directory a GGUF file converts to, under the cache (keyed by the file's path, size and
    modification time); converted now if it is not there yet."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = gguf_cache_dir() / f"{path.stem}-{key}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out, force=True) as tmp:
        _convert_gguf(path, tmp, show_progress)
    return out


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _open(path: Path) -> Any:
    gguf = _gguf()
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the reader raises many kinds on a short or garbled file
        raise CheckpointError(f"{path}: not a readable GGUF file (truncated or corrupt: {e})") from e


def _config_from_gguf(reader: Any, arch: str, vocab: int, tied: bool) -> dict[str, Any]:
    def kv(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

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
    if _field(reader, "tokenizer.ggml.pre") == "qwen2":
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


def _convert_gguf(path: Path, out: Path, show_progress: bool) -> None:
    from moepager.models.quantized import quantization_config

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
    cfg = architecture_for(config).parse_config(config)
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    produce: dict[str, Callable[[], torch.Tensor]] = {}
    _dense_entries(tensors, arch, config, cfg, entries, produce)
    fmt = _expert_entries(tensors, cfg, entries, produce)
    write_shards(out, entries, lambda name: produce[name](), desc=f"converting {path.name}",
                 show_progress=show_progress, leave=False)
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
                   entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                   produce: dict[str, Callable[[], torch.Tensor]]) -> None:
    """Every tensor but the routed experts, under its HF name (llama's q/k rows unpermuted)."""
    from moepager.models.synth import tensor_specs

    mapped = _name_map(arch, config["num_hidden_layers"])
    for hf_name, shape in tensor_specs(config):
        if is_routed_expert(hf_name):
            continue
        gname = mapped(hf_name)
        if gname not in tensors.meta and hf_name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue
        kind = tensors.kind(gname)

        def dense(gname: str = gname, shape: tuple[int, ...] = tuple(shape), hf_name: str = hf_name) -> torch.Tensor:
            t = tensors.floats(gname, shape)
            if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                t = _unpermute(t, cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads)
            return t.contiguous()
        entries.append((hf_name, FLOAT_TYPES.get(kind, tensors.float_dtype), tuple(shape)))
        produce[hf_name] = dense


def _expert_entries(tensors: GGUFTensors, cfg: ModelConfig, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                    produce: dict[str, Callable[[], torch.Tensor]]) -> QuantFormat | None:
    """Every routed expert's tensors under the architecture's per-expert names; returns the quantized format
    they take (all Q4_0: int4; all Q8_0: int8; otherwise float)."""
    kinds = {tensors.kind(n) for layer in cfg.moe_layers for n in _expert_names(layer)}
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

    naming = architecture_for(cfg.raw).expert_naming
    for layer in cfg.moe_layers:
        for e in range(count):
            for template, gname, (n, k) in zip((naming.gate, naming.up, naming.down), _expert_names(layer),
                                               ((f, d), (f, d), (d, f))):
                name = template.format(layer=layer, expert=e)
                if fmt is None:
                    entries.append((name, FLOAT_TYPES.get(tensors.kind(gname), tensors.float_dtype), (n, k)))
                    produce[name] = (lambda gname=gname, e=e, n=n, k=k:
                                     tensors.floats(gname, (count, n, k))[e].contiguous())
                    continue
                for suffix, dt, shp in projection_tensors(fmt, n, k, torch.float16):
                    entries.append((name + suffix, dt, shp))
                    produce[name + suffix] = (lambda gname=gname, e=e, n=n, k=k, suffix=suffix:
                                              projection(gname, e, n, k).tensor(suffix).contiguous())
    return fmt
