"""Checkpoint reading: sharded files, and every kind of bad checkpoint gets a clear CheckpointError."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moepager.checkpoints.safetensors import Checkpoint
from moepager.errors import CheckpointError, UnsupportedArchitectureError
from moepager.models.attention import ForwardBatch
from moepager.runtime.builder import load_model


def _logits(path):
    lm = load_model(path, show_progress=False)
    cache = lm.model.make_cache(1, 16, torch.float32, torch.device("cpu"))
    return lm.model(torch.tensor([[3, 1, 4, 1, 5]]), ForwardBatch.build(torch.arange(5)[None]), cache)


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_identically(hf_checkpoint, tmp_path):
    hf, path = hf_checkpoint("qwen2_moe")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    with torch.no_grad():
        assert torch.equal(_logits(sharded), _logits(path))


def test_missing_path_and_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no config.json"):
        Checkpoint(tmp_path)


def test_unsupported_architecture_lists_supported(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("mixtral")[1], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM.*MixtralForCausalLM"):
        load_model(path, show_progress=False)


def test_corrupt_header_names_the_file(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("olmoe")[1], tmp_path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CheckpointError, match="model.safetensors.*corrupt"):
        Checkpoint(path)


def test_truncated_file_names_the_tensor(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("olmoe")[1], tmp_path)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="tensor '.*' is truncated"):
        Checkpoint(path)


def test_missing_tensor_is_named(hf_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(hf_checkpoint("qwen3_moe")[1], tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.self_attn.q_norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.layers.2.self_attn.q_norm.weight' is missing"):
        load_model(path, show_progress=False)


def test_config_shape_mismatch_names_tensor_and_shapes(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("mixtral")[1], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 20
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor '.*experts.*' has shape \[24, 32\] but config.json implies"):
        load_model(path, show_progress=False)


def test_missing_config_key_is_named(hf_checkpoint, tmp_path):
    path = _copy(hf_checkpoint("olmoe")[1], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["num_experts_per_tok"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        load_model(path, show_progress=False)


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe", "deepseek_v3"])
def test_a_model_loaded_under_inference_mode_computes_the_same(hf_checkpoint, arch):
    """Weights created under torch.inference_mode have no version counter; nothing the forward caches (the
    fused q/k/v projection, Qwen3's joint q/k norm weight) may read one. Replacing a weight remakes the caches."""
    from tests.runtime.test_offload import logits_run

    _, path = hf_checkpoint(arch)
    ref = logits_run(load_model(path, show_progress=False), rows=1)
    with torch.inference_mode():
        loaded = load_model(path, show_progress=False)
    assert all(torch.equal(a, b) for a, b in zip(logits_run(loaded, rows=1), ref))
    attn = loaded.model.model.layers[0].self_attn
    if arch == "qwen3_moe":
        with torch.inference_mode():
            attn.k_norm.weight = torch.nn.Parameter(attn.k_norm.weight * 2, requires_grad=False)
        assert not all(torch.equal(a, b) for a, b in zip(logits_run(loaded, rows=1), ref))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["stored", "bf16"])
def test_window_bytes_are_the_dense_weights_read_around_each_moe_layer(hf_checkpoint, dtype):
    from moepager.loading.build import LoadOptions, open_checkpoint

    model, path = hf_checkpoint("qwen2_moe")  # layer 1 is dense (mlp_only_layers), 0 and 2 route
    opened = open_checkpoint(path, LoadOptions(dtype=dtype))
    size = opened.dtype.itemsize
    state = {k: v.numel() * size for k, v in model.state_dict().items()}

    def layer(i: int) -> int:
        return sum(n for k, n in state.items() if k.startswith(f"model.layers.{i}.") and ".experts." not in k)

    per_layer, head = opened.window_bytes()
    assert opened.config.moe_layers == (0, 2)
    assert per_layer == (layer(0) + layer(2)) / 2 and layer(0) > 0  # attention, router, shared expert, norms
    assert head == state["lm_head.weight"] + state["model.norm.weight"] + layer(1) + 32 * size  # + an embedding row
