"""The built-in demo model shipped as package data: a real checkpoint within its size limit, documented by a
model card, better than a unigram model, run identically by moepager and transformers, used by default."""

from __future__ import annotations

import json
import re

import pytest
import torch

from moepager.checkpoints.default import default_model_path
from moepager.cli.main import main
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams

PROMPTS = ["The history of", "In this paper, we", "def main():"]


def test_checkpoint_is_a_small_bf16_qwen3_moe_with_tokenizer():
    path = default_model_path()
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["dtype"] == "bfloat16"
    assert config["num_local_experts"] >= 32 and 4 <= config["num_experts_per_tok"] <= 8
    assert 6 <= config["num_hidden_layers"] <= 8
    assert (path / "model.safetensors").stat().st_size <= 30 * 2**20
    tok = json.loads((path / "tokenizer_config.json").read_text())
    assert "im_start" in tok["chat_template"]


def test_model_card_reports_validation_perplexity_below_the_unigram_baseline():
    card = (default_model_path() / "README.md").read_text()
    valid = float(re.search(r"validation loss \(bf16 checkpoint\) \| [\d.]+ \(ppl ([\d.]+)\)", card).group(1))
    unigram = float(re.search(r"unigram baseline on validation \| [\d.]+ \(ppl ([\d.]+)\)", card).group(1))
    assert valid < unigram / 4
    assert "python scripts/train_demo_model.py" in card and "Greedy continuations" in card


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moepager_and_transformers_produce_the_same_greedy_text(dtype):
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    path = default_model_path()
    hf = Qwen3MoeForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(path, dtype=dtype, show_progress=False)
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        [out] = llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))
        assert out.prompt_token_ids == ids[0].tolist()
        assert out.token_ids == ref[0, ids.shape[1]:].tolist()
        assert out.text == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)


def test_generate_and_info_use_the_built_in_model_by_default(capsys):
    assert main(["generate", "The history of", "--max-tokens", "8", "--quiet", "--seed", "0"]) == 0  # sampled: seeded
    out = capsys.readouterr().out
    text = out.splitlines()[0]
    assert text.startswith("The history of") and len(text) > len("The history of") + 8
    assert main(["info"]) == 0
    info = capsys.readouterr().out
    assert "Qwen3MoeForCausalLM" in info and "32" in info
