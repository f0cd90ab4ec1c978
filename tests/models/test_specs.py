"""Each architecture's checkpoint spec (models/specs.py) and its model code (models/registry.py) name the same
architectures and agree; the formats reach a checkpoint's description without loading a model module."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moepager.errors import CheckpointError, UnsupportedArchitectureError
from moepager.models.registry import ARCHITECTURES, architecture_for
from moepager.models.specs import SPECS, spec_for


def test_every_architecture_has_one_spec_and_reads_it():
    assert set(SPECS) == set(ARCHITECTURES)
    for name, arch in ARCHITECTURES.items():
        spec = SPECS[name]
        assert (arch.name, arch.parse_config, arch.expert_naming) == (spec.name, spec.parse_config,
                                                                      spec.expert_naming)


def test_spec_for_refuses_what_it_cannot_name():
    with pytest.raises(CheckpointError, match="no 'architectures' list"):
        spec_for({"model_type": "llama"})
    with pytest.raises(UnsupportedArchitectureError, match="'LlamaForCausalLM'; supported: DeepseekV2ForCausalLM"):
        spec_for({"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        architecture_for({"architectures": ["LlamaForCausalLM"]})


def test_the_formats_load_no_model_code():
    """Importing every checkpoint format (and parsing a config through its spec) loads none of the model's modules:
    the formats sit below the models."""
    code = ("import sys, moepager.checkpoints.gguf_read, moepager.checkpoints.gguf_write, "
            "moepager.checkpoints.quantized, moepager.checkpoints.split, moepager.checkpoints.expert_reader, "
            "moepager.checkpoints.derived, moepager.checkpoints.disk\n"
            "from moepager.models.specs import spec_for\n"
            "spec_for({'architectures': ['MixtralForCausalLM']})\n"
            "print(sorted(m for m in sys.modules if m.startswith('moepager.models')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['moepager.models', 'moepager.models.config', 'moepager.models.naming', " \
                          "'moepager.models.specs']"
