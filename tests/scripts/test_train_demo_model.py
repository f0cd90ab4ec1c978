"""The demo-model training script end to end on a tiny corpus and a tiny model: it writes a checkpoint that
moepager loads and runs, and a run stopped and resumed reaches the same weights as an uninterrupted one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_demo_model.py"
TINY = ["--vocab-size", "300", "--hidden-size", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "16", "--experts", "4", "--top-k", "2", "--expert-ffn", "16", "--seq-len", "16",
        "--batch", "2", "--steps", "4", "--warmup", "1", "--threads", "1", "--eval-every", "2", "--save-every", "1"]
FILES = ["wikipedia_texts.txt", "c4_texts.txt", "arxiv_texts.txt", "github_oss_with_stack_texts.txt"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i, name in enumerate(FILES):
        paras = [f"Paragraph {j} of file {i}: the cache keeps experts near the compute. " * 8 for j in range(100)]
        (root / name).write_text("\n\n".join(paras), encoding="utf-8")
    return root


def train(corpus: Path, out: Path, work: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--corpus", str(corpus), "--out", str(out), "--work-dir", str(work),
           *TINY, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_writes_a_checkpoint_moepager_runs_and_a_model_card(corpus, tmp_path):
    proc = train(corpus, tmp_path / "out", tmp_path / "work")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_local_experts"] == 4
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    card = (out / "README.md").read_text()
    assert "unigram baseline" in card and "validation loss" in card and "--steps 4" in card
    assert len(json.loads((out / "training_log.json").read_text())) == 4
    llm = LLM(out, show_progress=False)
    [completion] = llm.generate("Paragraph 3", SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(completion.token_ids) == 5


def test_stopped_and_resumed_run_reaches_the_same_weights(corpus, tmp_path):
    assert train(corpus, tmp_path / "a", tmp_path / "wa").returncode == 0
    first = train(corpus, tmp_path / "b", tmp_path / "wb", "--stop-after", "2")
    assert first.returncode == 0 and "continue with --resume" in first.stderr
    assert not (tmp_path / "b").exists()
    refused = train(corpus, tmp_path / "b", tmp_path / "wb")
    assert refused.returncode != 0 and "--resume" in refused.stderr
    changed = train(corpus, tmp_path / "b", tmp_path / "wb", "--resume", "--lr", "0.01")
    assert changed.returncode != 0 and "lr" in changed.stderr
    resumed = train(corpus, tmp_path / "b", tmp_path / "wb", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()
