"""GGUF out and in: an exported file loads back into exactly the original weights (bf16), its Q8_0/Q4_0 blocks
decode as ggml decodes them, and bad files get one clear error each."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moepager.cli.main import main
from moepager.errors import CheckpointError, ConfigError
from moepager.experts.quant import QuantExpertWeights
from moepager.models.gguf_io import (export_gguf, gguf_checkpoint, q4_0_blocks, q4_0_to_int4, q4_0_values,
                                     q8_0_blocks, q8_0_values, resolve_model_path)
from moepager.models.load import load_model
from moepager.models.synth import make_model
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from tests.runtime.test_offload import logits_run

gguf = pytest.importorskip("gguf")
ARCHS = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"]


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


@pytest.mark.parametrize("arch", ARCHS)
def test_a_bf16_export_loads_back_into_the_same_model(tiny, tmp_path, arch):
    path = tiny(arch)
    out = export_gguf(path, tmp_path / "m.gguf", show_progress=False)
    ref = load_model(path, torch.float32, show_progress=False)  # bf16 weights, computed in fp32 (exact upcast)
    got = load_model(resolve_model_path(out), torch.float32, show_progress=False)
    assert got.config.raw["architectures"] == ref.config.raw["architectures"]
    assert all(torch.equal(a, b) for a, b in zip(logits_run(got), logits_run(ref)))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    from_gguf, original = LLM(out, show_progress=False), LLM(path, show_progress=False)
    assert from_gguf.tokenizer.encode("The history of") == original.tokenizer.encode("The history of")
    assert from_gguf.generate(["The history of"], params)[0].token_ids == \
        original.generate(["The history of"], params)[0].token_ids
    assert from_gguf.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        original.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_q8_0_and_q4_0_blocks_decode_as_ggml_decodes_them():
    w = torch.randn(6, 96) * 0.1
    q8, q4 = q8_0_blocks(w), q4_0_blocks(w)
    assert q8.shape == (6, 3 * 34) and q4.shape == (6, 3 * 18)
    ref8 = gguf.quants.dequantize(q8.numpy(), gguf.GGMLQuantizationType.Q8_0)
    ref4 = gguf.quants.dequantize(q4.numpy(), gguf.GGMLQuantizationType.Q4_0)
    np.testing.assert_array_equal(q8_0_values(q8, 6, 96).numpy(), ref8)
    np.testing.assert_array_equal(q4_0_values(q4, 6, 96).numpy(), ref4)
    assert np.abs(ref4 - w.numpy()).max() < 0.1 * w.abs().max().item() and np.abs(ref8 - w.numpy()).max() < 0.01
    p = q4_0_to_int4(q4, 6, 96)
    assert p.q.shape == (6, 48) and p.scale.dtype == torch.float16 and p.scale.shape == (6, 3)


@pytest.mark.parametrize("kind", ["q4_0", "q8_0"])
def test_quantized_exports_load_as_int4_and_int8_experts(tiny, tmp_path, kind):
    path = tiny("qwen3_moe")
    out = export_gguf(path, tmp_path / f"m-{kind}.gguf", kind, show_progress=False)
    loaded = load_model(resolve_model_path(out), show_progress=False)
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
    assert sum(p.stat().st_size for p in resolve_model_path(out).glob("*.safetensors")) < out.stat().st_size * 1.1


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


def test_bad_exports_and_bad_files_get_one_clear_error_each(tiny, tmp_path):
    with pytest.raises(ConfigError, match="export-gguf supports .*not DeepseekV2ForCausalLM"):
        export_gguf(tiny("deepseek_v2"), tmp_path / "x.gguf", show_progress=False)
    with pytest.raises(ConfigError, match="unknown --type 'q5_k'"):
        export_gguf(tiny("olmoe"), tmp_path / "x.gguf", "q5_k", show_progress=False)
    with pytest.raises(ConfigError, match="is a directory"):
        export_gguf(tiny("olmoe"), tmp_path, show_progress=False)
    assert list(tmp_path.glob("*.gguf")) == [] and not list(tmp_path.glob(".x.partial*"))
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model_path(tmp_path / "missing.gguf")

    good = export_gguf(tiny("olmoe"), tmp_path / "good.gguf", show_progress=False)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        gguf_checkpoint(truncated, show_progress=False)

    other = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(other, "gemma")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match="architecture 'gemma' is not supported; moepager reads llama, olmoe"):
        gguf_checkpoint(other, show_progress=False)

    odd = tmp_path / "q4_1.gguf"
    w = gguf.GGUFWriter(odd, "olmoe")
    w.add_tensor("token_embd.weight", np.zeros((4, 2 * 20), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match="tensor types Q4_1 are not supported; moepager reads F32, F16, BF16, "
                                              "Q8_0, Q4_0"):
        gguf_checkpoint(odd, show_progress=False)
    assert not list((tmp_path / "cache" / "gguf").glob("*/config.json"))  # nothing half-converted left behind
