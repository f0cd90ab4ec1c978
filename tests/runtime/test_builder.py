"""The composition root's short form (runtime/builder.py `load_model`): the root `build` a run uses, with the
caller's executor as a `GivenExecutor` placement, or the placement the configuration resolves."""

from __future__ import annotations

import pytest
import torch

from moepager.checkpoints.default import default_model_path
from moepager.config import EngineConfig
from moepager.errors import BudgetError, ConfigError
from moepager.experts.executor import ResidentExecutor
from moepager.loading.build import resident_executor
from moepager.placements import PLACEMENTS
from moepager.placements.base import GivenExecutor
from moepager.runtime.builder import build, load_model
from moepager.store.budget import ENV_AVAILABLE
from tests.runtime.test_offload import logits_run

CPU = torch.device("cpu")


def test_load_model_is_the_roots_model_with_the_given_executor(hf_checkpoint):
    path = hf_checkpoint("qwen3_moe")[1]
    made = []

    def factory(reader, cfg, progress):
        made.append((reader.shape, cfg.num_experts, cfg.moe_layers))
        return resident_executor(CPU)(reader, cfg, progress)

    given = load_model(path, torch.float32, executor_factory=factory, show_progress=False)
    built = build(EngineConfig(model=str(path), dtype="float32"), path, False).loaded
    assert made == [(given.expert_shape, given.config.num_experts, given.config.moe_layers)]
    assert isinstance(built.experts, ResidentExecutor) and isinstance(given.experts, ResidentExecutor)
    assert (given.dense_format, given.expert_format) == (built.dense_format, built.expert_format)
    for a, b in zip(logits_run(given, rows=2), logits_run(built, rows=2)):
        assert torch.equal(a, b)


def test_load_model_without_a_factory_takes_the_resolved_placement(hf_checkpoint):
    loaded = load_model(hf_checkpoint("olmoe")[1], torch.float32, show_progress=False)
    assert isinstance(loaded.experts, ResidentExecutor) and loaded.execution == ""


def test_load_model_checks_its_arguments_as_the_command_line_would(hf_checkpoint):
    with pytest.raises(ConfigError, match="unknown --expert-dtype 'int3'"):
        load_model(hf_checkpoint("olmoe")[1], expert_dtype="int3", show_progress=False)


def test_a_given_executor_is_no_registered_placement():
    assert GivenExecutor.name not in PLACEMENTS and GivenExecutor.splits


def test_a_given_executor_is_not_fitted(monkeypatch):
    """The fit sizes what the root places; a caller that places the experts itself decides their memory, so a machine
    the fit would refuse still loads through the caller's executor."""
    monkeypatch.setenv(ENV_AVAILABLE, "300MiB")
    with pytest.raises(BudgetError, match="does not fit here"):
        load_model(default_model_path(), show_progress=False)
    loaded = load_model(default_model_path(), executor_factory=resident_executor(CPU), show_progress=False)
    assert isinstance(loaded.experts, ResidentExecutor) and loaded.execution == ""
