"""make-model's random tensors: large ones drawn ahead on threads from generators of their own, the same bytes every
time; small ones from the seed's one generator in order."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

import moepager.checkpoints.synth as synth


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
