"""Quantized experts in whole models: load-time quantization, `moepager quantize` checkpoints (which must
load into exactly the same weights), paging them, and the errors around both."""

from __future__ import annotations

import json

import pytest
import torch

from moepager.checkpoints import quantized as quantized_module
from moepager.checkpoints.default import default_model_path
from moepager.checkpoints.quantized import quantize_checkpoint, stored_format
from moepager.checkpoints.safetensors import Checkpoint, write_safetensors
from moepager.cli.main import main
from moepager.config import EngineConfig, ExpertFormat, StoreConfig
from moepager.errors import CheckpointError, ConfigError
from moepager.experts.quant import QuantFormat
from moepager.placements.paged import paged_executor
from moepager.placements.stores import read_buffer_bytes
from moepager.runtime.builder import load_model
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from tests.conftest import transformers
from tests.runtime.test_offload import logits_run

CPU = torch.device("cpu")
FORMATS = {"int8": {}, "int4": {}, "int4-g64-zp": dict(int4_group=64, int4_zero_point=True)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny HF checkpoints whose experts int4 groups divide (hidden 64, expert intermediate 64): Qwen3-MoE in
    transformers' fused layout and Mixtral in the hub's per-expert w1/w2/w3 layout."""
    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    configs = {"qwen3_moe": (transformers.Qwen3MoeConfig(**common, head_dim=16, intermediate_size=96,
                                                         moe_intermediate_size=64, num_experts=6,
                                                         num_experts_per_tok=2, norm_topk_prob=True), False),
               "mixtral": (transformers.MixtralConfig(**common, intermediate_size=64, num_local_experts=4,
                                                      num_experts_per_tok=2), True)}
    out = {}
    for arch, (config, hub) in configs.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        path = tmp_path_factory.mktemp(arch)
        model.save_pretrained(path, save_original_format=hub)
        out[arch] = path
    return out


def _kwargs(name: str) -> dict:
    return dict(expert_dtype=name.split("-")[0], **FORMATS[name])


def _quantize(path, out, name: str):
    kw = FORMATS[name]
    return quantize_checkpoint(path, out, name.split("-")[0], kw.get("int4_group", 32),
                               kw.get("int4_zero_point", False), show_progress=False)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_quantized_checkpoint_loads_the_weights_load_time_quantization_makes(checkpoints, tmp_path, arch, name):
    path = checkpoints[arch]
    at_load = load_model(path, show_progress=False, **_kwargs(name))
    out = _quantize(path, tmp_path / "q", name)
    stored = load_model(out, show_progress=False)
    assert stored.expert_shape == at_load.expert_shape  # the checkpoint's own format, with no option given
    assert torch.equal(stored.experts.kernels.arena, at_load.experts.kernels.arena)
    ref = logits_run(at_load)
    assert all(torch.equal(a, b) for a, b in zip(logits_run(stored), ref))
    on_disk = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    float_size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    assert on_disk < float_size * (0.7 if name == "int8" else 0.5)


@pytest.mark.parametrize("name", FORMATS)
def test_quantized_runs_stay_close_to_the_float_run(checkpoints, name):
    path = checkpoints["qwen3_moe"]
    ref = logits_run(load_model(path, show_progress=False))
    got = logits_run(load_model(path, show_progress=False, **_kwargs(name)))
    for a, b in zip(got, ref):
        rel = ((a - b).norm() / b.norm()).item()
        assert 0 < rel < (0.02 if name == "int8" else 0.15), rel


def _reader(path):
    from moepager.checkpoints.expert_reader import ExpertReader
    from moepager.experts.weights import ExpertShape
    from moepager.models.registry import architecture_for

    ckpt = Checkpoint(path)
    arch = architecture_for(ckpt.config)
    cfg = arch.parse_config(ckpt.config)
    stored = stored_format(ckpt.config)
    shape = ExpertShape(cfg.hidden_size, cfg.expert_intermediate_size, torch.float32,
                        QuantFormat(stored.bits, stored.group, stored.zero_point, "cpu"))
    return ExpertReader(ckpt, arch.expert_naming, shape, cfg.moe_layers[0], "off", stored)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_paging_quantized_experts_is_lossless(checkpoints, tmp_path, name):
    path = _quantize(checkpoints["mixtral"], tmp_path / "q", name)
    resident = load_model(path, show_progress=False)
    ref = logits_run(resident)
    nbytes = resident.expert_shape.nbytes
    buffers = read_buffer_bytes(_reader(path), StoreConfig().io_threads)
    for host_tier in (False, True):
        config = StoreConfig(expert_memory=str(2 * nbytes + (0 if host_tier else buffers)),
                             host_memory=str(3 * nbytes + buffers) if host_tier else None, warm=False, direct_io="off")
        paged = load_model(path, executor_factory=paged_executor(config, CPU, host_tier=host_tier),
                           show_progress=False, direct_io="off")
        assert paged.experts.store.device.buffers.dtype == torch.uint8
        assert all(torch.equal(a, b) for a, b in zip(logits_run(paged), ref))
        assert sum(p.loads_on_demand for p in paged.experts.store.counters.phases.values()) > 0
        paged.experts.store.close()


def test_a_quantized_checkpoint_runs_dequantized_when_asked(checkpoints, tmp_path):
    path = _quantize(checkpoints["qwen3_moe"], tmp_path / "q", "int8")
    quant, floats = load_model(path, show_progress=False), load_model(path, show_progress=False, expert_dtype="fp32")
    assert floats.expert_shape.quant is None
    for a, b in zip(logits_run(quant), logits_run(floats)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_quantize_cli_and_a_run_that_says_its_format(demo_checkpoint, tmp_path, capsys):
    out = tmp_path / "int4"
    assert main(["quantize", "--model", str(demo_checkpoint), "--experts", "int4", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "moepager", "format_version": 1, "experts": "int4",
                                             "group_size": 32, "zero_point": False, "modules": "routed experts"}
    assert stored_format(config) == QuantFormat(4, 32, False, "plain")
    assert (out / "tokenizer.json").exists() and not list(tmp_path.glob(".int4.partial*"))
    capsys.readouterr()
    assert main(["info", "--model", str(out)]) == 0
    info = capsys.readouterr().out
    shape = load_model(out, show_progress=False).expert_shape
    assert "int4 (groups of 32, symmetric)" in info and f"bytes per expert       {shape.nbytes / 1024:.2f} KiB" in info
    assert main(["generate", "--model", str(out), "--max-tokens", "4", "--temperature", "0", "Water"]) == 0
    assert "int4 (groups of 32, symmetric) (lossy)" in capsys.readouterr().out
    assert main(["generate", "--model", str(demo_checkpoint), "--expert-dtype", "int8", "--max-tokens", "4",
                 "Water"]) == 0
    assert "expert format     int8 (lossy)" in capsys.readouterr().out
    llm = LLM(demo_checkpoint, show_progress=False)
    llm.generate(["Water"], SamplingParams(max_tokens=2))
    assert llm.last_stats.experts == "float32" and "(lossy)" not in llm.last_stats.table()


def test_bad_options_and_checkpoints_get_one_clear_error(checkpoints, demo_checkpoint, tmp_path):
    path = checkpoints["qwen3_moe"]
    with pytest.raises(ConfigError, match="unknown --expert-dtype 'int2'"):
        EngineConfig(experts=ExpertFormat("int2"))
    with pytest.raises(ConfigError, match="need --expert-dtype int4"):
        EngineConfig(experts=ExpertFormat("int8", int4_group=64))
    with pytest.raises(ConfigError, match="group size 128 does not divide the hidden size 64"):
        load_model(path, show_progress=False, expert_dtype="int4", int4_group=128)
    with pytest.raises(ConfigError, match="differs from the run's dtype float32"):
        load_model(path, show_progress=False, expert_dtype="bf16")
    q8 = _quantize(path, tmp_path / "q8", "int8")
    with pytest.raises(ConfigError, match="stores int8 experts"):
        load_model(q8, show_progress=False, expert_dtype="int4")
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_checkpoint(q8, tmp_path / "again", "int4", show_progress=False)
    # a quantized checkpoint that lost a scale
    ckpt = Checkpoint(q8)
    lost = "experts.3.down_proj.weight_scale"
    kept = [(n, loc.dtype, loc.shape) for n, loc in ckpt.locations.items() if not n.endswith(lost)]

    def produce(name):
        t = torch.empty(ckpt.locations[name].shape, dtype=ckpt.locations[name].dtype)
        ckpt.read_exact_into(name, t)
        return t
    write_safetensors(q8 / "model.safetensors", kept, produce)
    with pytest.raises(CheckpointError, match="experts.3.down_proj.weight_scale"):
        load_model(q8, show_progress=False)
    # an unknown quantization method
    bad = json.loads((q8 / "config.json").read_text())
    bad["quantization_config"] = {"quant_method": "fp8"}
    (q8 / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="quantization method 'fp8' is not supported"):
        load_model(q8, show_progress=False)


def test_an_interrupted_quantize_leaves_nothing(demo_checkpoint, tmp_path, monkeypatch):
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    real = quantized_module.quantize_projection
    monkeypatch.setattr(quantized_module, "quantize_projection", failing)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(demo_checkpoint, tmp_path / "out", "int8", show_progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_in_bf16_a_quantized_checkpoint_and_load_time_quantization_agree_bit_for_bit(tmp_path, name):
    from moepager.loading.synth import make_model

    path = make_model(tmp_path / "bf16", "tiny", "qwen3_moe", dtype="bfloat16", show_progress=False)
    at_load = LLM(path, show_progress=False, config=EngineConfig(model=str(path), experts=ExpertFormat(name)))
    stored = LLM(_quantize(path, tmp_path / "q", name), show_progress=False)
    assert stored.loaded.expert_shape == at_load.loaded.expert_shape
    assert torch.equal(stored.loaded.experts.kernels.arena, at_load.loaded.experts.kernels.arena)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert stored.generate(["The history of"], params)[0].token_ids == \
        at_load.generate(["The history of"], params)[0].token_ids


def test_a_quantized_copy_of_a_model_with_a_card_says_what_it_is(tmp_path):
    out = quantize_checkpoint(default_model_path(), tmp_path / "q", "int8", show_progress=False)
    card = (out / "README.md").read_text()
    assert card.startswith("> **A quantized copy.**") and "int8" in card.splitlines()[0]
    assert (default_model_path() / "README.md").read_text() in card  # the original's card follows, whole
