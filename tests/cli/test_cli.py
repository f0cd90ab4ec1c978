"""The command line end to end: make-model -> info -> generate, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moepager.cli.main import main
from moepager.loading.synth_presets import ARCH_TYPES, preset_config
from moepager.models.registry import tensor_specs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["make-model", "--arch", "mixtral", "--preset", "tiny", "--out", str(out)]) == 0
    return out


def test_info_reports_geometry_and_bytes(tiny, capsys):
    assert main(["info", "--model", str(tiny)]) == 0
    text = capsys.readouterr().out
    assert "MixtralForCausalLM" in text and "8, top-2" in text
    assert "bytes per expert       24.00 KiB" in text  # 3 * 64 * 64 * 2 bytes


def test_generate_streams_text_and_writes_stats(tiny, tmp_path, capsys):
    stats = tmp_path / "stats.json"
    code = main(["generate", "--model", str(tiny), "The history of", "--max-tokens", "6", "--ignore-eos",
                 "--stats-json", str(stats), "--quiet"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("The history of") and "TPOT median" in out
    data = json.loads(stats.read_text())
    assert data["generated_tokens"] == 6 and data["num_prompts"] == 1


def test_info_shows_the_minimum_and_what_budgets_hold(tiny, capsys):
    assert main(["info", "--model", str(tiny), "--expert-memory", "50%", "--expert-memory", "100KiB"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "read buffers 40.00 KiB" in text  # 5 reading threads x 8 KiB bounce buffers
    assert "minimum expert memory 88.00 KiB (one MoE layer's top-2 + read buffers)" in text
    # 2 layers x 8 experts of 24 KiB: half of their 384 KiB, less the buffers, holds 6
    assert ("--expert-memory 50% 6 experts (144.00 KiB + 40.00 KiB read buffers): 4 cached + 2 stream rows, "
            "37.5% of experts") in text
    assert "--expert-memory 100KiB 2 experts" in text


def test_generate_with_an_expert_budget_matches_resident_and_reports_paging(tiny, tmp_path, capsys):
    common = ["generate", "--model", str(tiny), "The history of", "--max-tokens", "8", "--ignore-eos", "--quiet",
              "--temperature", "0"]
    assert main(common) == 0
    resident = capsys.readouterr().out.split("\n")[0]
    stats = tmp_path / "stats.json"
    assert main(common + ["--expert-memory", "25%", "--cold", "--direct-io", "off", "--stats-json", str(stats)]) == 0
    out = capsys.readouterr().out
    assert out.split("\n")[0] == resident and "decode expert hit rate" in out
    data = json.loads(stats.read_text())["experts"]
    assert (data["config"]["device slots"], data["config"]["stream rows"]) == (2, 2)  # 25% of 16 experts
    assert data["prefill"]["loads_on_demand"] >= 4


@pytest.mark.parametrize("kernel", ["gather", "grouped"])
def test_every_expert_kernel_generates_the_same_text_resident_and_paged(tiny, capsys, kernel):
    common = ["generate", "--model", str(tiny), "The history of", "--max-tokens", "8", "--ignore-eos", "--quiet",
              "--temperature", "0"]
    assert main(common + ["--expert-kernel", kernel]) == 0
    resident = capsys.readouterr().out.split("\n")[0]
    assert main(common + ["--expert-kernel", kernel, "--expert-memory", "25%", "--direct-io", "off"]) == 0
    assert capsys.readouterr().out.split("\n")[0] == resident
    with pytest.raises(SystemExit) as exit_info:
        main(common + ["--expert-kernel", "simd"])
    assert exit_info.value.code == 2 and "invalid choice: 'simd'" in capsys.readouterr().err


def test_generate_several_prompts_and_chat(tiny, capsys):
    assert main(["generate", "--model", str(tiny), "one", "two", "--max-tokens", "3", "--chat", "--quiet",
                 "--temperature", "0.8", "--seed", "1", "--top-p", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "[0] one" in out and "[1] two" in out


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "/definitely/not/here", "hi"], "does not exist"),
    (["generate", "--model", "{tiny}", "hi", "--top-p", "2"], "top_p must be in (0, 1]"),
    (["generate", "--model", "{tiny}", "hi", "--max-tokens", "100000", "--quiet"], "exceeds the model's context"),
    (["generate", "--model", "{tiny}", "hi", "--threads", "0"], "--threads must be >= 1"),
    (["make-model", "--preset", "tiny", "--out", "{tmp}/x"], "needs --arch"),
    (["generate", "--model", "{tiny}", "hi", "--expert-memory", "30KiB", "--quiet"],
     "--expert-memory 30KiB holds 0 experts, below the minimum of 2 (one MoE layer's top-k = 48.00 KiB + 40.00 KiB "
     "of read buffers)"),
    (["generate", "--model", "{tiny}", "hi", "--expert-memory", "lots"], "--expert-memory 'lots' is not a size"),
    (["generate", "--model", "{tiny}", "hi", "--host-memory", "1GiB"], "--host-memory applies to --device cuda"),
    (["generate", "--model", "{tiny}", "hi", "--expert-memory", "50%", "--io-threads", "0"],
     "--io-threads must be >= 1"),
    (["generate", "--model", "{tiny}", "hi", "--expert-memory", "50%", "--predictor", "gate-lookahead",
      "--prefetch-threads", "0"], "--prefetch-threads must be >= 1"),
    (["generate", "--model", "{tiny}", "hi", "--expert-memory", "50%", "--predictor", "gate-lookahead",
      "--prefetch-min-p", "1.5"], "--prefetch-min-p must be between 0 and 1"),
    (["make-model", "--preset", "mixtral-8x7b", "--arch", "olmoe", "--out", "{tmp}/x"], "is a mixtral model"),
])
def test_bad_input_gives_one_line_and_exit_2(tiny, tmp_path, capsys, argv, message):
    argv = [a.format(tiny=tiny, tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_no_traceback_from_the_console_script(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moepager.cli.main", "info", "--model", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "no config.json" in proc.stderr


@pytest.mark.parametrize("preset, expected_b", [("mixtral-8x7b", 46.70), ("qwen3-30b-a3b", 30.53),
                                                ("olmoe-1b-7b", 6.92), ("deepseek-v2-lite", 15.71),
                                                ("qwen1.5-moe-a2.7b", 14.32)])
def test_presets_have_the_real_models_parameter_counts(preset, expected_b):
    total = sum(_numel(shape) for _, shape in tensor_specs(preset_config(preset, None, None)))
    assert total / 1e9 == pytest.approx(expected_b, rel=0.01)


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def test_every_architecture_has_a_tiny_preset():
    for arch in ARCH_TYPES:
        assert tensor_specs(preset_config("tiny", arch, None))


def test_the_default_threads_are_the_cores_other_processes_leave_idle(monkeypatch):
    from moepager.cli import generate

    monkeypatch.setattr(generate.os, "cpu_count", lambda: 4)
    for busy, threads in ((0.1, 4), (2.1, 2), (4.0, 1)):
        monkeypatch.setattr(generate, "others_busy_cores", lambda cores, busy=busy: busy)
        got, note = generate.idle_cores()
        assert got == threads and (note == "" if threads == 4 else f"computing with {threads} thread" in note)
    assert 0 <= generate.others_busy_cores(4) <= 4  # the real sample: this process's own work left out
