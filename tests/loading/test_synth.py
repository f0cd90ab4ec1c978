"""make-model's random tensors: large ones drawn ahead on threads from generators of their own, the same bytes every
time; small ones from the seed's one generator in order."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

import moepager.loading.synth as synth


def tensors(path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(f)
    return out


def test_tensors_drawn_on_threads_are_the_same_every_time_and_apart_from_the_sequential_ones(tmp_path, monkeypatch):
    sequential = tensors(synth.make_model(tmp_path / "a", "tiny", "olmoe", show_progress=False))
    monkeypatch.setattr(synth, "OWN_GENERATOR_NUMEL", 4096)  # the tiny geometry's matrices count as large
    first = tensors(synth.make_model(tmp_path / "b", "tiny", "olmoe", show_progress=False))
    monkeypatch.setattr(synth, "GENERATORS", 1)  # one thread draws them: the same bytes
    again = tensors(synth.make_model(tmp_path / "c", "tiny", "olmoe", show_progress=False))
    assert first.keys() == again.keys() == sequential.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    large = [k for k, t in first.items() if t.numel() >= 4096 and not k.endswith("norm.weight")]
    assert large and all(not torch.equal(first[k], sequential[k]) for k in large)
    distinct = {first[k].flatten()[:8].float().sum().item() for k in large}
    assert len(distinct) == len(large)  # every large tensor from its own generator: no two draw the same values


def gguf_tensors(path) -> dict[str, bytes]:
    import gguf
    return {t.name: bytes(t.data.tobytes()) for t in gguf.GGUFReader(path).tensors}


def test_a_gguf_made_directly_holds_what_make_model_then_export_gguf_write(tmp_path, monkeypatch):
    """`make-model --out X.gguf` draws the same tensors in the same order as a checkpoint and writes them through the
    streaming GGUF writer: byte for byte what exporting the checkpoint writes, large (threaded) tensors included."""
    from moepager.checkpoints.gguf_write import export_gguf

    monkeypatch.setattr(synth, "OWN_GENERATOR_NUMEL", 4096)  # both kinds of tensor: own generators and the shared one
    for arch in ("qwen3_moe", "deepseek_v2"):
        exported = export_gguf(synth.make_model(tmp_path / arch, "tiny", arch, show_progress=False),
                               tmp_path / f"{arch}-export.gguf", show_progress=False)
        direct = synth.make_model(tmp_path / f"{arch}.gguf", "tiny", arch, show_progress=False)
        a, b = gguf_tensors(exported), gguf_tensors(direct)
        assert sorted(a) == sorted(b) and all(a[k] == b[k] for k in a), arch


def test_a_gguf_make_model_refuses_float32_and_an_existing_file(tmp_path):
    import pytest

    from moepager.errors import MoepagerError

    with pytest.raises(MoepagerError, match="bfloat16 or float16"):
        synth.make_model(tmp_path / "m.gguf", "tiny", "olmoe", dtype="float32", show_progress=False)
    (tmp_path / "m.gguf").write_bytes(b"x")
    with pytest.raises(MoepagerError, match="exists"):
        synth.make_model(tmp_path / "m.gguf", "tiny", "olmoe", show_progress=False)
    assert (tmp_path / "m.gguf").read_bytes() == b"x"
