"""GGUF out, and what reading it back shares: `moepager export-gguf` writes a checkpoint as a GGUF file
llama.cpp runs; the ggml block codecs, tensor names and layouts here serve both directions.

Architectures (Hugging Face -> GGUF): Qwen3-MoE -> qwen3moe, Qwen2-MoE -> qwen2moe, OLMoE -> olmoe, Mixtral ->
llama (with llama.cpp's query/key row permutation for its rotary layout), DeepSeek-V2/V3 -> deepseek2. Tensor
names come from the `gguf` package's own name map; metadata keys and the choice of F32 for norms, biases and
routers follow llama.cpp's convert_hf_to_gguf.py, read to learn the format. Experts are written as three stacked
tensors per layer (ffn_gate_exps, ffn_up_exps [E, F, D], ffn_down_exps [E, D, F]).

deepseek2 is MLA in llama.cpp's absorbed form: one KV head whose keys are the latent plus the rotary key
(kv_lora_rank + qk_rope_head_dim wide) and whose values are the latent, so kv_b_proj is written split, as
attn_k_b (each head's key up-projection, transposed: [H, r, nope]) and attn_v_b ([H, v, r]); the per-head
("MLA") key and value lengths, leading dense layers, shared experts and the router (V2: softmax; V3: sigmoid,
groups, correction biases as exp_probs_b) go into the metadata. DeepSeek's YaRN (mscale == mscale_all_dim) is
written as llama.cpp's yarn keys with yarn_log_multiplier = 0.1 * mscale_all_dim, which llama.cpp divides out
again. Reading a deepseek2 file gives DeepSeek-V3 when its gating function is sigmoid, DeepSeek-V2 otherwise.

Types: `--type bf16|f16` converts every matrix; `q8_0|q4_0` quantize the routed experts (what moepager's
`--expert-dtype int8|int4` quantize) and keep every other tensor in the checkpoint's dtype. `--dense-type q8_0`
quantizes the dense projections to Q8_0 as well: attention, dense and shared-expert MLPs and the LM head (a tied
head written as its own output.weight, which llama.cpp prefers to the embedding), what moepager's `--dense-dtype
int8|int8-a8` quantize; embeddings, norms, routers and MLA's split kv_b stay as they are. llama.cpp's own
converter quantizes the token embedding too, which decoding only reads a row of. Blocks of 32 along
the input dimension with an fp16 scale d each (ggml's block_q8_0 / block_q4_0): Q8_0 q = round(x / d),
d = absmax / 127; Q4_0 w = (q - 8) * d, d = m / -8 with m the block's value of largest magnitude, the block's
16 bytes holding elements j (low nibble) and j + 16 (high nibble). Our quantizers choose the integers against the
fp16-rounded scale (experts/quant.py), so a Q4_0 file read back is exactly moepager's int4 (groups of 32,
symmetric) with those scales.

Reading GGUF files back: checkpoints/gguf_read.py.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from moepager.atomic_io import atomic_file, check_file
from moepager.checkpoints.derived import split_parts
from moepager.checkpoints.dtypes import checkpoint_dtype
from moepager.checkpoints.expert_reader import ExpertReader, is_routed_expert
from moepager.checkpoints.quantized import stored_format
from moepager.checkpoints.safetensors import Checkpoint
from moepager.errors import ConfigError
from moepager.experts.quant import (
    QuantizedProjection,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
)
from moepager.experts.weights import ExpertShape, ExpertWeights
from moepager.models.config import ModelConfig
from moepager.models.specs import spec_for

GGUF_ARCHS = {"Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe", "OlmoeForCausalLM": "olmoe",
              "MixtralForCausalLM": "llama", "DeepseekV2ForCausalLM": "deepseek2", "DeepseekV3ForCausalLM": "deepseek2"}
HF_ARCHS = {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
            "llama": "MixtralForCausalLM", "deepseek2": "DeepseekV2ForCausalLM"}
"""GGUF architecture -> HF architecture read back (a deepseek2 file with sigmoid gating reads as DeepSeek-V3)."""
EXPORT_TYPES = ("bf16", "f16", "q8_0", "q4_0")
DENSE_EXPORT_TYPES = ("q8_0",)
Q8_0_DENSE = tuple(f".{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_a", "attn_q_b",
                                            "attn_kv_a_mqa", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_shexp",
                                            "ffn_up_shexp", "ffn_down_shexp"))
"""Per-block dense projections `--dense-type q8_0` quantizes (and the LM head, output.weight)."""
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
F32_TENSORS = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
"""Written in F32 whatever the type, as llama.cpp's converter does (norms and routers; 1-D tensors too)."""
BLOCK = 32
QWEN2_PRE = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
             "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
"""Qwen2's pre-tokenizer split (the GGUF pre type `qwen2`)."""
GPT2_PRES = ("gpt-2", "olmo", "mpt")
"""GGUF pre types that split with GPT-2's regex in llama.cpp (llama-vocab.cpp)."""
READ_PRES = (*GPT2_PRES, "qwen2")


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
    """block_q8_0 bytes -> the exact fp32 values q * d of an [N, K] matrix (the `gguf` package's dequantizer)."""
    return _dequantized(raw, "Q8_0", n, k)


def q4_0_values(raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """block_q4_0 bytes -> the exact fp32 values (q - 8) * d of an [N, K] matrix (the `gguf` package's)."""
    return _dequantized(raw, "Q4_0", n, k)


def _dequantized(raw: torch.Tensor, kind: str, n: int, k: int) -> torch.Tensor:
    values = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(n, k)


# ---- names --------------------------------------------------------------------------------------------------


def name_map(arch: str, blocks: int) -> Callable[[str], str | None]:
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    tmap = gguf.get_tensor_name_map(model_arch, blocks)
    # DeepSeek-V3's router bias is a buffer named `..._bias`; the name map knows it as a `.bias`.
    return lambda name: tmap.get_name(name.replace("e_score_correction_bias", "e_score_correction.bias"),
                                      try_suffixes=(".weight", ".bias"))


def expert_names(layer: int) -> tuple[str, str, str]:
    return f"blk.{layer}.ffn_gate_exps.weight", f"blk.{layer}.ffn_up_exps.weight", f"blk.{layer}.ffn_down_exps.weight"


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's llama-arch rotary layout: each head's rows reordered from [half, half] to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
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
    pre_type = _pre_type(pre)
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
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_type)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # merges, the special ids (eos, bos, pad ... from tokenizer_config.json and config.json) and the chat template,
    # as llama.cpp's own converter finds them
    special = gguf.SpecialVocab(directory, load_merges=True, n_vocab=size)
    if not special.merges:
        special.merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    special.add_special_token.setdefault("bos", False)  # moepager's tokenizers add no BOS (nor does the HF one)
    special.add_to_gguf(writer, quiet=True)


def _pre_type(pre: dict[str, Any]) -> str:
    """The GGUF pre-tokenizer name of a tokenizer.json pre-tokenizer: GPT-2's regex inside ByteLevel (`gpt-2`) or
    Qwen2's split before a regex-free ByteLevel (`qwen2`); any other split is refused, since llama.cpp would
    tokenize differently."""
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"] and (parts[0].get("pattern") or {}).get("Regex") == QWEN2_PRE \
            and not parts[1].get("use_regex", True):
        return "qwen2"
    raise ConfigError("export-gguf writes byte-level BPE tokenizers that split as GPT-2 or Qwen2 do; this one's "
                      f"pre-tokenizer is {json.dumps(pre)[:200]}")


@dataclass(frozen=True)
class ExportSource:
    """What an export reads a model from: its config, the folder of its tokenizer files, its tensors other than the
    routed experts (HF name -> dtype and shape, in the order they are written) with a reader for one, a reader for one
    routed expert ((gate rows then up rows [2F, D], down [D, F])) and the experts' dtype. A checkpoint directory is one
    (`checkpoint_source`); make-model's seeded generator is another (loading/synth.py), so a random model of a
    real geometry is written as GGUF without a checkpoint of its size on disk first."""

    name: str
    config: dict[str, Any]
    directory: Path
    dense: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    tensor: Callable[[str], torch.Tensor]
    expert: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    expert_dtype: torch.dtype


def checkpoint_source(checkpoint: Checkpoint) -> ExportSource:
    """A checkpoint directory as an export's source (its config checked exportable first)."""
    cfg = _exportable(checkpoint.config, checkpoint.path)
    dtype = checkpoint_dtype(checkpoint)
    shape = ExpertShape(cfg.hidden_size, cfg.expert_intermediate_size, dtype)
    reader = ExpertReader(checkpoint, spec_for(checkpoint.config).expert_naming, shape, cfg.moe_layers[0],
                          "off")
    scratch = ExpertWeights.empty(shape)

    def tensor(name: str) -> torch.Tensor:
        loc = checkpoint.location(name)
        t = torch.empty(loc.shape, dtype=loc.dtype)
        checkpoint.read_exact_into(name, t)
        return t

    def expert(layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        reader.read((layer, e), scratch.buffer)
        return scratch.gate_up_2FD, scratch.down_DF

    dense = {n: (loc.dtype, loc.shape) for n, loc in checkpoint.locations.items() if not is_routed_expert(n)}
    return ExportSource(checkpoint.path.name, checkpoint.config, checkpoint.path, dense, tensor, expert, dtype)


def export_gguf(model: str | os.PathLike[str], out: str | os.PathLike[str], type_: str = "bf16",
                show_progress: bool = True, dense_type: str | None = None, force: bool = False) -> Path:
    """Write checkpoint `model` as a GGUF file of `type_` (bf16, f16, q8_0, q4_0) to `out` (atomically; an existing
    file only with `force`); `dense_type` q8_0 quantizes the dense projections too."""
    check_types(type_, dense_type)
    out_path = check_file(out, "--out", replace=force, inputs={"--model": model})
    assert out_path is not None
    checkpoint = Checkpoint(model)
    try:
        write_gguf(checkpoint_source(checkpoint), out_path, type_, dense_type, show_progress)
    finally:
        checkpoint.files.close()
    return out_path


def check_types(type_: str, dense_type: str | None) -> None:
    if type_ not in EXPORT_TYPES:
        raise ConfigError(f"unknown --type '{type_}'; choose from {', '.join(EXPORT_TYPES)}")
    if dense_type is not None and dense_type not in DENSE_EXPORT_TYPES:
        raise ConfigError(f"unknown --dense-type '{dense_type}'; choose from {', '.join(DENSE_EXPORT_TYPES)}")


def gguf_bytes(source: ExportSource, type_: str = "bf16", dense_type: str | None = None) -> int:
    """The tensor bytes a GGUF file of `source` takes (what `write_gguf` will write, less metadata and padding)."""
    return sum(t.nbytes for t in _plan(source, _exportable(source.config, source.directory), type_, dense_type))


def write_gguf(source: ExportSource, out_path: Path, type_: str = "bf16", dense_type: str | None = None,
               show_progress: bool = True) -> None:
    """Write `source` to `out_path` (atomically), one tensor at a time: the tensors are planned from their shapes
    first, so the file's header is written before any tensor is read and no more than one MoE layer's experts are
    ever held in memory (a model larger than RAM exports; writing all tensors at the end, as before 2026-12-02,
    held the whole model)."""
    check_types(type_, dense_type)
    cfg = _exportable(source.config, source.directory)
    name = GGUF_ARCHS[cfg.architecture]
    plan = _plan(source, cfg, type_, dense_type)
    with atomic_file(out_path) as tmp:
        writer = gguf.GGUFWriter(tmp, name)
        _write_metadata(writer, name, cfg, source, type_)
        for t in plan:
            writer.add_tensor_info(t.gname, t.shape, t.np_dtype, t.nbytes, raw_dtype=t.raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with tqdm(total=sum(t.nbytes for t in plan), unit="B", unit_scale=True, desc=f"writing {out_path.name}",
                  disable=not show_progress, leave=False) as bar:
            for t in plan:
                data = t.make()
                if data.nbytes != t.nbytes:
                    raise ConfigError(f"export-gguf: tensor '{t.gname}' has {data.nbytes} bytes, planned {t.nbytes}")
                writer.write_tensor_data(data)
                bar.update(t.nbytes)
        writer.close()


@dataclass(frozen=True)
class _Planned:
    """One GGUF tensor before it is read: its name, numpy shape and dtype, bytes, ggml type, and how to make it."""

    gname: str
    shape: tuple[int, ...]
    np_dtype: np.dtype
    nbytes: int
    raw_dtype: gguf.GGMLQuantizationType | None
    make: Callable[[], np.ndarray]


BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}
"""Bytes of one ggml block of BLOCK elements."""


def _planned(gname: str, shape: tuple[int, ...], kind: torch.dtype | str, make: Callable[[], torch.Tensor]
             ) -> _Planned:
    """A tensor of `shape` written as `kind`: a float dtype (bf16 as ggml BF16) or q8_0 / q4_0 blocks."""
    if isinstance(kind, str):
        byte_shape = (*shape[:-1], shape[-1] // BLOCK * BLOCK_BYTES[kind])
        blocks = q8_0_blocks if kind == "q8_0" else q4_0_blocks
        qtype = gguf.GGMLQuantizationType.Q8_0 if kind == "q8_0" else gguf.GGMLQuantizationType.Q4_0
        return _Planned(gname, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), qtype,
                        lambda: blocks(make().reshape(-1, shape[-1])).reshape(byte_shape).numpy())
    numel = math.prod(shape)
    if kind == torch.bfloat16:
        return _Planned(gname, shape, np.dtype(np.uint16), 2 * numel, gguf.GGMLQuantizationType.BF16,
                        lambda: make().to(kind).contiguous().view(torch.int16).numpy().view(np.uint16))
    np_dtype = np.dtype(np.float16 if kind == torch.float16 else np.float32)
    return _Planned(gname, shape, np_dtype, np_dtype.itemsize * numel, None,
                    lambda: make().to(kind).contiguous().numpy())


def _plan(source: ExportSource, cfg: ModelConfig, type_: str, dense_type: str | None) -> list[_Planned]:
    float_type = {"f16": torch.float16, "bf16": torch.bfloat16}.get(type_, source.expert_dtype)
    float_type = torch.bfloat16 if float_type == torch.float32 else float_type
    name = GGUF_ARCHS[cfg.architecture]
    return _plan_dense(source, name, cfg, float_type, dense_type == "q8_0") + _plan_experts(source, cfg, type_,
                                                                                              float_type)


def _exportable(config: dict[str, Any], path: Path) -> ModelConfig:
    """The model's parsed config, or the reason llama.cpp's architectures cannot take it."""
    hf_arch = config.get("architectures", ["?"])[0]
    if hf_arch not in GGUF_ARCHS:
        raise ConfigError(f"export-gguf supports {', '.join(sorted(GGUF_ARCHS))}, not {hf_arch}")
    if stored_format(config) is not None:
        raise ConfigError(f"{path} is a moepager-quantized checkpoint; export its float original")
    if split_parts(config) != 1:
        raise ConfigError(f"{path} stores its experts in parts (moepager split); export its original")
    cfg = spec_for(config).parse_config(config)
    deepseek2 = GGUF_ARCHS[hf_arch] == "deepseek2"
    first_moe = cfg.moe_layers[0] if deepseek2 else 0
    if tuple(cfg.moe_layers) != tuple(range(first_moe, cfg.num_layers)):
        raise ConfigError("export-gguf needs every layer to be a MoE layer (after DeepSeek's leading dense ones: "
                          f"llama.cpp has no other dense layers); this model's MoE layers are {list(cfg.moe_layers)}")
    if deepseek2:
        _deepseek2_exportable(config, cfg)
    elif cfg.rope.scaling:
        raise ConfigError("export-gguf writes the default rotary embedding only for this architecture; this model "
                          f"scales it ({cfg.rope.scaling.get('rope_type')})")
    return cfg


def _deepseek2_exportable(config: dict[str, Any], cfg: ModelConfig) -> None:
    """What llama.cpp's deepseek2 cannot express: V2's group-limited router (llama.cpp scores a group by its
    two best experts, as V3 does, not by its best), non-interleaved rotary halves, and YaRN variants other than
    DeepSeek's own (mscale == mscale_all_dim, which leaves cos/sin unscaled and scales the softmax by
    mscale(factor, mscale_all_dim)^2: llama.cpp's [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX])."""
    v3 = config["architectures"][0] == "DeepseekV3ForCausalLM"
    if not v3 and (config.get("topk_method") or "greedy") != "greedy" and (config.get("n_group") or 1) > 1:
        raise ConfigError(f"export-gguf: DeepSeek-V2's '{config['topk_method']}' router (groups scored by their best "
                          "expert) has no llama.cpp equivalent; only topk_method 'greedy' exports")
    if v3 and not config.get("rope_interleave", True):
        raise ConfigError("export-gguf: rope_interleave false (rotary halves) has no llama.cpp deepseek2 equivalent")
    s = dict(cfg.rope.scaling or {})
    kind = s.get("rope_type", "default")
    if kind == "default":
        return
    odd = [k for k in ("attention_factor", "extrapolation_factor") if s.get(k) is not None]
    if kind != "yarn" or s.get("mscale_all_dim") in (None, 0) or s.get("mscale") != s.get("mscale_all_dim") \
            or not s.get("truncate", True) or odd:
        raise ConfigError("export-gguf writes DeepSeek's YaRN (mscale == mscale_all_dim, truncated ramp) or no "
                          f"scaling; this model's rotary scaling is {s}")


def _write_metadata(writer: Any, name: str, cfg: ModelConfig, source: ExportSource, type_: str) -> None:
    config = source.config
    writer.add_name(source.name)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(int(config.get("intermediate_size", cfg.expert_intermediate_size)))
    writer.add_head_count(cfg.num_heads)
    writer.add_rope_freq_base(float(cfg.rope.theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.top_k)
    writer.add_expert_feed_forward_length(cfg.expert_intermediate_size)
    if name == "deepseek2":
        _deepseek2_metadata(writer, cfg, config)
    else:
        writer.add_head_count_kv(cfg.num_kv_heads)
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
    _tokenizer_metadata(writer, source.directory, config)


def _deepseek2_metadata(writer: Any, cfg: ModelConfig, config: dict[str, Any]) -> None:
    """MLA as llama.cpp runs it: an MQA (one KV head) over the latent, keys kv_lora_rank + rope wide, values
    kv_lora_rank wide; the per-head ("MLA") lengths; leading dense layers, shared experts, the router's
    scoring, and DeepSeek's YaRN (keys as llama.cpp's convert_hf_to_gguf.py writes them)."""
    rank, rope, nope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"]), int(config["qk_nope_head_dim"])
    v3 = config["architectures"][0] == "DeepseekV3ForCausalLM"
    writer.add_head_count_kv(1)
    writer.add_key_length(rank + rope)
    writer.add_value_length(rank)
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(int(config["v_head_dim"]))
    writer.add_kv_lora_rank(rank)
    writer.add_q_lora_rank(int(config.get("q_lora_rank") or 0))  # 0: a full q_proj (V2-Lite)
    writer.add_rope_dimension_count(rope)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_leading_dense_block_count(cfg.moe_layers[0])
    writer.add_expert_shared_count(int(config.get("n_shared_experts") or 0))
    writer.add_expert_weights_scale(float(config.get("routed_scaling_factor") or 1.0))
    writer.add_expert_weights_norm(bool(config.get("norm_topk_prob", v3)))
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if v3 and (config.get("n_group") or 1) > 1:
        writer.add_expert_group_count(int(config["n_group"]))
        writer.add_expert_group_used_count(int(config["topk_group"]))
    s = cfg.rope.scaling or {}
    if s.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(s["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(s["original_max_position_embeddings"]))
        writer.add_rope_scaling_yarn_beta_fast(float(s.get("beta_fast") or 32))
        writer.add_rope_scaling_yarn_beta_slow(float(s.get("beta_slow") or 1))
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(s["mscale_all_dim"]))  # llama.cpp divides by 0.1 again


def _plan_dense(source: ExportSource, name: str, cfg: ModelConfig, float_type: torch.dtype, q8_0: bool = False
                ) -> list[_Planned]:
    """Every tensor but the routed experts, under its GGUF name (norms and routers in F32; with `q8_0` the dense
    projections in Q8_0, a tied LM head as its own output.weight). Each is planned from a meta tensor of its shape
    put through the same permutation and split the write does."""
    mapped = name_map(name, cfg.num_layers)
    last: list[Any] = [None, None]  # the HF tensor whose parts were made last (a split kv_b's two come in turn)

    def parts(hf_name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if name == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads)
        if name == "deepseek2" and hf_name.endswith("kv_b_proj.weight"):
            return list(zip((hf_name.replace("kv_b_proj", "k_b_proj"), hf_name.replace("kv_b_proj", "v_b_proj")),
                            _split_kv_b(t, cfg.raw)))
        return [(hf_name, t)]

    def part(hf_name: str, i: int) -> torch.Tensor:
        if last[0] != hf_name:
            last[:] = hf_name, parts(hf_name, source.tensor(hf_name))
        return last[1][i][1]

    out = []
    for hf_name, (dtype, shape) in source.dense.items():
        for i, (part_name, meta) in enumerate(parts(hf_name, torch.empty(shape, dtype=dtype, device="meta"))):
            gname = mapped(part_name)
            if gname is None:
                raise ConfigError(f"tensor '{hf_name}' has no GGUF name for {name}")
            shp = tuple(meta.shape)

            def make(hf_name: str = hf_name, i: int = i) -> torch.Tensor:
                return part(hf_name, i)
            blocks = q8_0 and shp[-1] % BLOCK == 0
            if blocks and cfg.tie_word_embeddings and gname == "token_embd.weight":  # the tied head, from this read
                out.append(_planned("output.weight", shp, "q8_0", make))
            if blocks and (gname == "output.weight" or gname.endswith(Q8_0_DENSE)):
                out.append(_planned(gname, shp, "q8_0", make))
                continue
            out.append(_planned(gname, shp, torch.float32 if len(shp) <= 1 or gname.endswith(F32_TENSORS)
                                else float_type, make))
    return out


def _split_kv_b(w: torch.Tensor, raw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's kv_b_proj [H * (nope + v), r] as llama.cpp's absorbed form wants it: k_b [H, r, nope] (each head's
    key up-projection transposed) and v_b [H, v, r]."""
    nope, v = int(raw["qk_nope_head_dim"]), int(raw["v_head_dim"])
    k_b, v_b = w.reshape(-1, nope + v, w.shape[-1]).split([nope, v], dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


def join_kv_b(k_b_HRN: torch.Tensor, v_b_HVR: torch.Tensor) -> torch.Tensor:
    """The inverse of `_split_kv_b` (reading a deepseek2 file back)."""
    return torch.cat((k_b_HRN.transpose(1, 2), v_b_HVR), dim=1).reshape(-1, v_b_HVR.shape[-1])


def _plan_experts(source: ExportSource, cfg: ModelConfig, type_: str, float_type: torch.dtype) -> list[_Planned]:
    """Each MoE layer's experts as three stacked tensors, in `float_type` or quantized to Q8_0/Q4_0; a layer's three
    stacks are read together, once, when its first is written."""
    d, f, e_count = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    held: dict[int, tuple[torch.Tensor, ...]] = {}

    def stacks(layer: int) -> tuple[torch.Tensor, ...]:
        if layer not in held:
            held.clear()
            gate = torch.empty(e_count, f, d, dtype=source.expert_dtype)
            up, down = torch.empty_like(gate), torch.empty(e_count, d, f, dtype=source.expert_dtype)
            for e in range(e_count):
                gate_up, down[e] = source.expert(layer, e)
                gate[e], up[e] = gate_up[:f], gate_up[f:]
            held[layer] = gate, up, down
        return held[layer]

    kind: torch.dtype | str = type_ if type_ in BLOCK_BYTES else float_type
    return [_planned(gname, shape, kind, lambda layer=layer, i=i: stacks(layer)[i])
            for layer in cfg.moe_layers
            for i, (gname, shape) in enumerate(zip(expert_names(layer), ((e_count, f, d), (e_count, f, d),
                                                                        (e_count, d, f))))]
