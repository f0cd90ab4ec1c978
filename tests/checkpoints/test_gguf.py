"""GGUF out and in: an exported file loads back into exactly the original weights (bf16), its Q8_0/Q4_0 blocks
decode as ggml decodes them, and bad files get one clear error each."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from moepager.checkpoints.default import default_model_path
from moepager.checkpoints.gguf_read import gguf_checkpoint, resolve_model_path
from moepager.checkpoints.gguf_write import (
    export_gguf,
    q4_0_blocks,
    q4_0_to_int4,
    q4_0_values,
    q8_0_blocks,
    q8_0_values,
)
from moepager.cli.main import main
from moepager.errors import CheckpointError, ConfigError
from moepager.experts.quant import QuantExpertWeights
from moepager.loading.synth import make_model
from moepager.models.attention import ForwardBatch
from moepager.models.registry import tensor_specs
from moepager.runtime.builder import load_model
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from tests.runtime.test_offload import logits_run

gguf = pytest.importorskip("gguf")
ARCHS = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v2", "deepseek_v3"]
YARN = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
"""DeepSeek's YaRN (V2-Lite's mscale) on a tiny context, so that the ramp and the softmax scale both act."""


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPAGER_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = make_model(tmp_path_factory.mktemp(arch), "tiny", arch, dtype="bfloat16", show_progress=False)
        return made[arch]
    return get


def edited(path, out, config=None, attention_gain=1.0, bias_seed=None):
    """A copy of checkpoint `path` with config keys replaced, the attention projections scaled by
    `attention_gain` (a peaky attention, so that a wrong softmax or rotary scale shows in the logits) and, for
    DeepSeek-V3, random router correction biases (so that choosing by them shows)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(raw | (config or {})))
    gen = torch.Generator().manual_seed(bias_seed or 0)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith(("q_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight")):
                tensors[name] = (t.float() * attention_gain).to(t.dtype)
            if bias_seed is not None and name.endswith("e_score_correction_bias"):
                tensors[name] = torch.randn(t.shape, generator=gen) * 0.5
        save_file(tensors, f, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("arch", [*ARCHS, "deepseek_v2-yarn"])
def test_a_bf16_export_loads_back_into_the_same_model(tiny, tmp_path, arch):
    path = tiny(arch.removesuffix("-yarn"))
    if arch.endswith("-yarn"):
        path = edited(path, tmp_path / "yarn", {"rope_parameters": YARN})
    elif arch == "deepseek_v3":
        path = edited(path, tmp_path / "biased", bias_seed=1)
    out = export_gguf(path, tmp_path / "m.gguf", show_progress=False)
    ref = load_model(path, torch.float32, show_progress=False)  # bf16 weights, computed in fp32 (exact upcast)
    got = load_model(resolve_model_path(out, tensor_specs), torch.float32, show_progress=False)
    assert got.config.raw["architectures"] == ref.config.raw["architectures"]
    assert all(torch.equal(a, b) for a, b in zip(logits_run(got), logits_run(ref)))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    from_gguf, original = LLM(out, show_progress=False), LLM(path, show_progress=False)
    assert from_gguf.tokenizer.encode("The history of") == original.tokenizer.encode("The history of")
    assert from_gguf.generate(["The history of"], params)[0].token_ids == \
        original.generate(["The history of"], params)[0].token_ids
    assert from_gguf.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        original.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])



def test_float_experts_are_read_from_the_gguf_file_in_place_and_page_from_it(tiny, tmp_path):
    """A bf16 file's conversion holds no expert: each points at its row of the GGUF stacks, and a paged run reads
    them from there (O_DIRECT) with the resident run's tokens; a file changed under a conversion is refused."""
    from moepager.checkpoints.safetensors import EXTERNAL, Checkpoint
    from moepager.config import StoreConfig
    from moepager.errors import CheckpointError

    path = tiny("qwen3_moe")
    out = export_gguf(path, tmp_path / "m.gguf", show_progress=False)
    converted = resolve_model_path(out, tensor_specs)
    ckpt = Checkpoint(converted)
    experts = {n: loc for n, loc in ckpt.locations.items() if ".experts." in n}
    assert experts and {loc.path for loc in experts.values()} == {out.resolve()}
    assert (converted / EXTERNAL).exists()
    stored = sum(f.stat().st_size for f in converted.glob("*.safetensors"))
    assert stored + sum(loc.nbytes for loc in experts.values()) < out.stat().st_size + 2**16  # no second copy
    original = Checkpoint(path)
    for name in list(experts)[::7]:
        a = torch.empty(experts[name].shape, dtype=torch.bfloat16)
        b = torch.empty_like(a)
        ckpt.read_exact_into(name, a)
        original.read_exact_into(name, b)
        assert torch.equal(a, b), name
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    resident = LLM(path, show_progress=False).generate(["The history of"], params)[0].token_ids
    paged = LLM(out, store=StoreConfig(expert_memory="25%"), show_progress=False)
    assert paged.generate(["The history of"], params)[0].token_ids == resident
    assert paged.last_stats.sections["experts"].to_dict()["decode"]["bytes_disk_per_token"] > 0
    with open(out, "ab") as f:  # the file changes under the conversion
        f.write(b"\0" * 64)
    with pytest.raises(CheckpointError, match="has changed since"):
        Checkpoint(converted)

def test_q8_0_and_q4_0_blocks_decode_as_ggml_decodes_them():
    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(0)) * 0.1
    q8, q4 = q8_0_blocks(w), q4_0_blocks(w)
    assert q8.shape == (6, 3 * 34) and q4.shape == (6, 3 * 18)
    ref8 = gguf.quants.dequantize(q8.numpy(), gguf.GGMLQuantizationType.Q8_0)
    ref4 = gguf.quants.dequantize(q4.numpy(), gguf.GGMLQuantizationType.Q4_0)
    np.testing.assert_array_equal(q8_0_values(q8, 6, 96).numpy(), ref8)
    np.testing.assert_array_equal(q4_0_values(q4, 6, 96).numpy(), ref4)
    # Q4_0 maps a block's largest magnitude m to -8 d: a value of the opposite sign near |m| clips at 7 d (error d,
    # |m| / 8); Q8_0 rounds to within d / 2 = |m| / 254.
    assert np.abs(ref4 - w.numpy()).max() <= 0.13 * w.abs().max().item()
    assert np.abs(ref8 - w.numpy()).max() <= w.abs().max().item() / 250
    p = q4_0_to_int4(q4, 6, 96)
    assert p.q.shape == (6, 48) and p.scale.dtype == torch.float16 and p.scale.shape == (6, 3)


@pytest.mark.parametrize("kind", ["q4_0", "q8_0"])
def test_quantized_exports_load_as_int4_and_int8_experts(tiny, tmp_path, kind):
    path = tiny("qwen3_moe")
    out = export_gguf(path, tmp_path / f"m-{kind}.gguf", kind, show_progress=False)
    loaded = load_model(resolve_model_path(out, tensor_specs), show_progress=False)
    assert loaded.expert_shape.quant.bits == (4 if kind == "q4_0" else 8)
    reader = gguf.GGUFReader(out)
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    assert t.tensor_type.name == kind.upper()
    want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)[3]  # expert 3 of MoE layer 1: [D, F]
    experts = loaded.experts.kernels
    w = experts.views[loaded.config.num_experts + 3]
    assert isinstance(w, QuantExpertWeights)
    got = w.dequantized()[1].numpy()
    if kind == "q4_0":  # bit-exact up to the fp16 -> bf16 rounding of the scales
        scale = torch.from_numpy(want.reshape(-1, 32)).abs().amax(1) / 8
        np.testing.assert_allclose(got, want, atol=float(scale.max()) * 8 * 2 ** -8, rtol=0)
    else:  # requantized per channel
        np.testing.assert_allclose(got, want, atol=float(np.abs(want).max()) / 127, rtol=0)
    converted = resolve_model_path(out, tensor_specs)
    assert sum(p.stat().st_size for p in converted.glob("*.safetensors")) < out.stat().st_size * 1.1


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2", "demo"])
def test_a_dense_q8_0_export_quantizes_the_projections_and_loads_back_close(tiny, tmp_path, arch):
    """--dense-type q8_0: attention, dense/shared MLPs and the LM head in Q8_0 (the built-in model's tied head as
    its own output.weight); embeddings, norms, routers and MLA's k_b/v_b as they were; read back dequantized,
    logits within Q8_0's rounding of the source model's."""
    path = default_model_path() if arch == "demo" else tiny(arch)
    out = tmp_path / "m.gguf"
    assert main(["export-gguf", "--model", str(path), "--type", "q8_0", "--dense-type", "q8_0", "--out", str(out)]) == 0
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["output.weight"] == "Q8_0" and types["token_embd.weight"] == "BF16"
    assert types["blk.1.attn_output.weight"] == "Q8_0" and types["blk.1.ffn_down_exps.weight"] == "Q8_0"
    assert types["blk.1.attn_norm.weight"] == "F32" and types["blk.1.ffn_gate_inp.weight"] == "F32"
    if arch == "deepseek_v2":
        assert types["blk.0.attn_kv_a_mqa.weight"] == "Q8_0" and types["blk.0.attn_k_b.weight"] == "BF16"
        assert types["blk.0.ffn_up.weight"] == "Q8_0"  # the leading dense layer's MLP
    else:
        assert types["blk.0.attn_q.weight"] == types["blk.0.attn_v.weight"] == "Q8_0"
    ref = logits_run(load_model(path, torch.float32, show_progress=False), steps=2, rows=1)
    converted = resolve_model_path(out, tensor_specs)
    got = logits_run(load_model(converted, torch.float32, show_progress=False), steps=2, rows=1)
    for a, b in zip(got, ref):
        assert (a - b).norm() < 0.05 * b.norm()
    with pytest.raises(ConfigError, match="--dense-type 'q4_0'"):
        export_gguf(path, tmp_path / "x.gguf", "q8_0", show_progress=False, dense_type="q4_0")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("arch", [*ARCHS, "demo"])
def test_dense_q8_0_quantizes_the_projections_dense_dtype_int8_quantizes(tiny, tmp_path, arch):
    """gguf_io.Q8_0_DENSE names in GGUF terms the projections `dense_quant.replace_dense` picks by module type (every
    nn.Linear not in KEEP, and the LM head, tied or not): the all-Q8_0 llama.cpp peer must quantize exactly what
    `--dense-dtype int8` does, so the two lists may not drift apart. Only rows of whole 32-value blocks can be Q8_0
    (DeepSeek-V3's tiny q_lora_rank of 24 is not), where int8's per-channel scales take any width."""
    from torch import nn

    from moepager.accel.dense_quant import KEEP
    from moepager.checkpoints.gguf_write import GGUF_ARCHS, name_map

    path = default_model_path() if arch == "demo" else tiny(arch)
    model = load_model(path, torch.float32, show_progress=False).model
    hf_class = json.loads((path / "config.json").read_text())["architectures"][0]
    mapped = name_map(GGUF_ARCHS[hf_class], len(model.model.layers))
    want = {mapped(f"{n}.weight") for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] not in KEEP and m.in_features % 32 == 0}
    if model.lm_head is None:
        want.add("output.weight")
    out = tmp_path / "m.gguf"
    export_gguf(path, out, "bf16", show_progress=False, dense_type="q8_0")
    got = {t.name for t in gguf.GGUFReader(out).tensors if t.tensor_type.name == "Q8_0"}
    assert None not in want and got == want


def test_llama_cpp_produces_our_greedy_tokens_from_an_exported_file(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    out = tmp_path / "demo.gguf"
    assert main(["export-gguf", "--out", str(out)]) == 0
    model = llama_cpp.Llama(str(out), n_ctx=128, n_threads=2, verbose=False)
    prompt = model.tokenize(b"The history of", add_bos=False)
    theirs = []
    for token in model.generate(prompt, temp=0.0, top_k=1):
        theirs.append(token)
        if len(theirs) == 16:
            break
    ours = LLM(out, show_progress=False).generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))
    assert ours[0].token_ids == theirs


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_llama_cpp_runs_our_deepseek2_exports_as_we_do(tiny, tmp_path, arch):
    """MLA as llama.cpp's absorbed MQA (kv_b split into k_b transposed and v_b), leading dense layers, shared
    experts, V2's softmax router under DeepSeek's YaRN, V3's sigmoid router with groups and correction biases:
    llama.cpp's logits on our bf16 export match ours (fp32 compute over the bf16 weights) to bf16 noise, and pick
    the same top-1 token at every position. Dropping the YaRN softmax scale from the file puts the logits ~0.3
    of a standard deviation apart, so the bound below catches it."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = edited(tiny(arch), tmp_path / "m", {"rope_parameters": YARN} if arch == "deepseek_v2" else None,
                  attention_gain=4.0, bias_seed=1 if arch == "deepseek_v3" else None)
    out = export_gguf(path, tmp_path / "m.gguf", show_progress=False)
    model = llama_cpp.Llama(str(out), n_ctx=64, n_threads=2, verbose=False, logits_all=True)
    prompt = model.tokenize(b"The history of the world is long and full of strange events", add_bos=False)
    model.eval(prompt)
    theirs = torch.from_numpy(np.array(model.scores[: len(prompt)]))
    loaded = load_model(path, torch.float32, show_progress=False)
    pos = torch.arange(len(prompt))[None]
    with torch.inference_mode():
        ours = loaded.model(torch.tensor([prompt]), ForwardBatch.build(pos),
                            loaded.model.make_cache(1, len(prompt), torch.float32, loaded.device))[0]
    assert (ours - theirs).abs().max() < 0.1 * ours.std()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_bad_exports_and_bad_files_get_one_clear_error_each(tiny, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="export-gguf supports .*not Qwen3ForCausalLM"):
        export_gguf(edited(tiny("qwen3_moe"), tmp_path / "dense", {"architectures": ["Qwen3ForCausalLM"]}),
                    tmp_path / "x.gguf", show_progress=False)
    grouped = edited(tiny("deepseek_v2"), tmp_path / "grouped",
                     {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1})
    with pytest.raises(ConfigError, match="'group_limited_greedy' router .* no llama.cpp equivalent"):
        export_gguf(grouped, tmp_path / "x.gguf", show_progress=False)
    odd_yarn = edited(tiny("deepseek_v2"), tmp_path / "odd-yarn", {"rope_parameters": YARN | {"mscale": 1.0}})
    with pytest.raises(ConfigError, match="DeepSeek's YaRN .*mscale == mscale_all_dim"):
        export_gguf(odd_yarn, tmp_path / "x.gguf", show_progress=False)
    with pytest.raises(ConfigError, match="default rotary embedding only"):
        export_gguf(edited(tiny("olmoe"), tmp_path / "olmoe-yarn", {"rope_parameters": YARN}), tmp_path / "x.gguf",
                    show_progress=False)
    split = edited(tiny("olmoe"), tmp_path / "split")
    tok = json.loads((split / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (split / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="split as GPT-2 or Qwen2 do"):
        export_gguf(split, tmp_path / "x.gguf", show_progress=False)
    with pytest.raises(ConfigError, match="unknown --type 'q5_k'"):
        export_gguf(tiny("olmoe"), tmp_path / "x.gguf", "q5_k", show_progress=False)
    with pytest.raises(ConfigError, match="is a directory"):
        export_gguf(tiny("olmoe"), tmp_path, show_progress=False)
    assert list(tmp_path.glob("*.gguf")) == [] and not list(tmp_path.glob(".x.partial*"))
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_path(tmp_path / "missing.gguf", tensor_specs)

    good = export_gguf(tiny("olmoe"), tmp_path / "good.gguf", show_progress=False)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        gguf_checkpoint(truncated, tensor_specs, show_progress=False)

    other = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(other, "gemma")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match="architecture 'gemma' is not supported; moepager reads deepseek2, llama"):
        gguf_checkpoint(other, tensor_specs, show_progress=False)

    odd = tmp_path / "q4_1.gguf"
    w = gguf.GGUFWriter(odd, "olmoe")
    w.add_tensor("token_embd.weight", np.zeros((4, 2 * 20), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match="tensor types Q4_1 are not supported; moepager reads F32, F16, BF16, "
                                              "Q8_0, Q4_0"):
        gguf_checkpoint(odd, tensor_specs, show_progress=False)
    import moepager.checkpoints.gguf_write as gguf_io

    monkeypatch.setattr(gguf_io, "_pre_type", lambda pre: "deepseek-llm")
    deepseek_pre = export_gguf(tiny("olmoe"), tmp_path / "deepseek-pre.gguf", show_progress=False)
    with pytest.raises(CheckpointError, match="pre-tokenizer 'deepseek-llm' is not supported; moepager reads gpt-2"):
        gguf_checkpoint(deepseek_pre, tensor_specs, show_progress=False)
    assert not list((tmp_path / "cache" / "gguf").glob("*/config.json"))  # nothing half-converted left behind


def test_our_q8_0_and_q4_0_blocks_against_the_gguf_packages_quantizer():
    """The writers keep their own rounding (the reason to keep them): a Q4_0 file reads back bit for bit as moepager's
    int4 and Q8_0 rounds as moepager's int8 does. Against the `gguf` package's quantizer: Q4_0 has the same scales
    and the same values but for rounding ties (one step apart); Q8_0's scale is the package's or up to 16 fp16 steps
    above it (moepager's int8 rounds its fp32 scale up to fp16), its error the package's within 1%."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    blocks = w.reshape(-1, 32)
    for ours, kind, width in ((q8_0_blocks(w), gguf.GGMLQuantizationType.Q8_0, 34),
                              (q4_0_blocks(w), gguf.GGMLQuantizationType.Q4_0, 18)):
        lib = gguf.quants.quantize(w.numpy(), kind)
        scales = [torch.from_numpy(b).reshape(-1, width)[:, :2].contiguous().view(torch.int16).reshape(-1).int()
                  for b in (ours.numpy(), lib)]
        steps = scales[0] - scales[1]  # fp16 steps (positive scales: the bit patterns are ordered)
        ours_err, lib_err = (torch.from_numpy(gguf.quants.dequantize(b, kind)).reshape(-1, 32) - blocks
                             for b in (ours.numpy(), lib))
        if kind == gguf.GGMLQuantizationType.Q4_0:
            assert (steps == 0).all()
            d = torch.from_numpy(lib).reshape(-1, width)[:, :2].contiguous().view(torch.float16).float()
            assert ((ours_err - lib_err).abs() <= d.abs() * 1.001).all()  # (Q4_0's d = max / -8)
        else:
            assert steps.min() == 0 and steps.max() <= 16
            assert ours_err.abs().mean() <= 1.01 * lib_err.abs().mean()


def test_stale_gguf_conversions_are_pruned(tmp_path, monkeypatch):
    import json

    from moepager.checkpoints.gguf_read import SOURCE, gguf_cache_dir, prune_gguf_cache

    monkeypatch.setenv("MOEPAGER_CACHE", str(tmp_path / "cache"))
    kept_file = tmp_path / "kept.gguf"
    kept_file.write_bytes(b"GGUF")
    st = kept_file.stat()
    for name, source in (("kept", {"path": str(kept_file), "size": st.st_size, "mtime_ns": st.st_mtime_ns}),
                         ("gone", {"path": str(tmp_path / "gone.gguf"), "size": 4, "mtime_ns": 1}),
                         ("changed", {"path": str(kept_file), "size": 99, "mtime_ns": 1})):
        entry = gguf_cache_dir() / name
        entry.mkdir(parents=True)
        (entry / SOURCE).write_text(json.dumps(source))
        (entry / "model.safetensors").write_bytes(b"x" * 1000)
    assert prune_gguf_cache()[0] == 2
    assert sorted(p.name for p in gguf_cache_dir().iterdir()) == ["kept"]
