"""Bad input and outputs, command by command: nothing a user owns is overwritten, outputs are checked before any
work, finished work survives a later error, and every refusal is one line with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from moepager.cli.main import main
from moepager.config import StoreConfig
from moepager.errors import MoepagerError, NumericalError
from moepager.loading import synth
from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams
from tests.conftest import expert_budget


def refused(capsys, argv, message):
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    return err


# -- 1. make-model never clobbers ---------------------------------------------------------------------------------
def test_make_model_refuses_a_non_empty_directory_and_force_replaces_it_whole(tiny, tmp_path, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_bytes(b"old shard")
    (out / "model.safetensors.index.json").write_text("{}")
    refused(capsys, ["make-model", "--preset", "tiny", "--arch", "olmoe", "--out", str(out)], "--force")
    assert (out / "model.safetensors.index.json").exists()  # untouched
    assert main(["make-model", "--preset", "tiny", "--arch", "olmoe", "--out", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert main(["info", "--model", str(out)]) == 0


def test_an_interrupted_make_model_leaves_the_old_model_and_no_partial_files(tiny, tmp_path, monkeypatch):
    out = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny", "--arch", "olmoe", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(synth, "write_shards", interrupted)
    assert main(["make-model", "--preset", "tiny", "--arch", "mixtral", "--out", str(out), "--force"]) == 130
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no .partial directory, no .tmp shards


# -- 2. outputs are checked before any work -------------------------------------------------------------------------
def test_unwritable_outputs_are_refused_before_any_work(tiny, trace, tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "dir"
    cases = [
        (["generate", "--model", str(tiny), "hi", "--record-trace", str(missing / "t.mpt")], "does not exist"),
        (["generate", "--model", str(tiny), "hi", "--stats-json", str(tmp_path)], "is a directory"),
        (["simulate", str(trace), "--json", "/proc/x/o.json"], "does not exist"),
        (["simulate", str(trace), "--plot", str(missing / "p.png")], "does not exist"),
        (["predictor", "fit", "--kind", "transition", "--trace", str(trace), "--out", str(missing / "p.pt")],
         "does not exist"),
        (["trace", "convert", "--format", "deepseek-csv", str(tmp_path), "/proc/x/o.mpt"], "does not exist"),
        (["trace", "stats", str(trace), "--json", str(missing / "s.json")], "does not exist"),
        (["predict-eval", "--trace", str(trace), "--predictor", "transition", "--json", str(missing / "e.json")],
         "does not exist"),
        (["calibrate", "--model", str(tiny), "--out", str(missing / "p.json")], "does not exist"),
    ]
    for argv, message in cases:
        refused(capsys, argv, message)
        assert capsys.readouterr().out == ""  # nothing ran, nothing printed
    assert not (tmp_path / "no").exists()  # no directory was created on the way


# -- 3. late validation -------------------------------------------------------------------------------------------
def test_simulate_checks_every_run_first_and_keeps_what_finished(trace, tmp_path, capsys, monkeypatch):
    refused(capsys, ["simulate", str(trace), "--policy", "lru,static-hot"], "needs a prior")
    refused(capsys, ["simulate", str(trace), "--capacity", "1"], "below one token's top-2")
    refused(capsys, ["simulate", str(trace), "--capacity", "1000"], "more than the trace has (8)")
    refused(capsys, ["simulate", str(trace), "--capacity", "1KiB"], "--capacity 1KiB holds 0 experts")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    refused(capsys, ["simulate", str(trace), "--plot", str(tmp_path / "p.png")], "needs matplotlib")


def test_predict_eval_checks_every_predictors_needs_before_fitting(tiny, trace, capsys):
    refused(capsys, ["predict-eval", "--trace", str(trace), "--predictor", "transition,token-wise"],
            "does not hold")
    refused(capsys, ["predict-eval", "--trace", str(trace), "--predictor", "gate-lookahead", "--model", str(tiny)],
            "trace geometry does not match the model")


# -- 4. budgets include the read buffers ----------------------------------------------------------------------------
def test_expert_budgets_include_the_read_buffers(tiny, capsys):
    nbytes = LLM(tiny, show_progress=False).loaded.expert_shape.nbytes
    llm = LLM(tiny, store=StoreConfig(expert_memory=expert_budget(nbytes, 4), direct_io="on"), show_progress=False)
    store = llm.loaded.experts.store
    rows = 4 + len(store.device.table.stream_rows)
    assert store.device.table.capacity == 4 and store.read_buffer_bytes == int(expert_budget(nbytes, 4)) - rows * nbytes
    with pytest.raises(MoepagerError, match=r"holds 0 experts, below the minimum of 2 .* of read buffers"):
        LLM(tiny, store=StoreConfig(expert_memory=str(2 * nbytes), direct_io="on"), show_progress=False)
    assert main(["info", "--model", str(tiny)]) == 0
    assert "read buffers" in capsys.readouterr().out


# -- 5. in-place rewrites are caught ----------------------------------------------------------------------------------
def test_rewriting_experts_in_place_with_the_old_timestamp_is_caught(tmp_path):
    assert main(["make-model", "--preset", "tiny", "--arch", "olmoe", "--out", str(tmp_path / "m")]) == 0
    path = tmp_path / "m" / "model.safetensors"
    llm = LLM(tmp_path / "m", store=StoreConfig(expert_memory="25%", warm=False), show_progress=False)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    st = path.stat()
    with open(path, "r+b") as f:  # the same file rewritten in place: same inode, same size
        f.seek(st.st_size - 4096)
        tail = f.read(4096)
        f.seek(st.st_size - 4096)
        f.write(bytes(b ^ 0x55 for b in tail))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old mtime put back
    assert (path.stat().st_size, path.stat().st_mtime_ns, path.stat().st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    with pytest.raises(Exception, match="modified while running"):
        llm.generate([[4, 5, 6, 7, 8, 9]], SamplingParams(max_tokens=8, ignore_eos=True))


# -- 6. no exit 0 with wrong results ---------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_weights_stop_generation_naming_where_they_appear(tmp_path, temperature):
    assert main(["make-model", "--preset", "tiny", "--arch", "qwen3_moe", "--out", str(tmp_path / "m")]) == 0
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.1.self_attn.o_proj.weight"][0, 0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    llm = LLM(tmp_path / "m", show_progress=False)
    with pytest.raises(NumericalError, match=r"in the prefill; they first appear in decoder layer 1 \(attention\)"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=temperature, seed=0))


# -- 7. no tracebacks --------------------------------------------------------------------------------------------------
def test_non_utf8_prompts_are_decoded_with_a_warning(tiny, tmp_path, capsys):
    (tmp_path / "p.txt").write_bytes(b"The \xff history")
    assert main(["generate", "--model", str(tiny), "--prompt-file", str(tmp_path / "p.txt"), "--max-tokens", "2",
                 "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "not valid UTF-8" in captured.err and captured.out.startswith("The \ufffd history")


def test_prompts_come_from_stdin(tiny):
    run = subprocess.run([sys.executable, "-m", "moepager.cli.main", "generate", "--model", str(tiny),
                          "--prompt-file", "-", "--max-tokens", "2", "--quiet"], input=b"Once upon",
                         capture_output=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith(b"Once upon")


def test_a_closed_pipe_is_not_a_traceback(tiny):
    proc = subprocess.Popen([sys.executable, "-m", "moepager.cli.main", "info", "--model", str(tiny)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and b"Traceback" not in err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("moepager ")


def test_a_prompt_too_long_is_not_echoed(tiny, capsys):
    refused(capsys, ["generate", "--model", str(tiny), "word " * 20_000, "--quiet"], "exceeds the model's context")
    assert capsys.readouterr().out == ""


def test_a_garbage_predictor_file_gets_no_unsafe_advice(tmp_path, capsys):
    (tmp_path / "p.pt").write_bytes(b"\x80\x04garbage")
    model = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny", "--arch", "olmoe", "--out", str(model)]) == 0
    err = refused(capsys, ["generate", "--model", str(model), "hi", "--expert-memory", "50%", "--predictor",
                           "transition", "--predictor-file", str(tmp_path / "p.pt")], "not a moepager predictor file")
    assert "weights_only" not in err


# -- 8. statistics that add up ---------------------------------------------------------------------------------------
def test_exposed_plus_hidden_is_the_load_time(tiny):
    llm = LLM(tiny, store=StoreConfig(expert_memory="25%", warm=False), show_progress=False)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=12, ignore_eos=True))
    for phase in ("prefill", "decode"):
        s = llm.last_stats.sections["experts"].phases[phase]
        assert s["load_s"] > 0 and 0 <= s["exposed_s"] <= s["load_s"]
        assert s["exposed_s"] + s["hidden_s"] == pytest.approx(s["load_s"])
    assert "summed over I/O threads" in llm.last_stats.table()


def test_trace_info_and_simulate_name_phases_alike(trace, capsys):
    assert main(["trace", "info", str(trace)]) == 0
    assert "recorded as decode" in capsys.readouterr().out
    assert main(["simulate", str(trace), "--capacity", "4"]) == 0
    assert "recorded as decode" in capsys.readouterr().out


# -- 9. options that would do nothing are refused --------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["--execution", "cpu-experts", "--cold"], "--cold does nothing without a paged store"),
    (["--execution", "cpu-experts", "--policy", "lfu"], "--policy does nothing without a paged store"),
    (["--record-hidden"], "--record-hidden does nothing without --record-trace"),
    (["--predictor-file", "x.pt"], "--predictor-file does nothing without --predictor"),
    (["--expert-memory", "50%", "--prefetch-threads", "2"], "--prefetch-threads does nothing without --predictor"),
    (["--expert-memory", "50%", "--prefetch-fixed"], "--prefetch-fixed does nothing without --predictor"),
    (["--expert-memory", "50%", "--prefetch-flex"], "--prefetch-flex does nothing without --predictor"),
    (["--expert-memory", "50%", "--prefetch-min-p", "0.5"], "--prefetch-min-p does nothing without --predictor"),
    (["--expert-memory", "50%", "--prefetch-no-yield"], "--prefetch-no-yield does nothing without --predictor"),
    (["--expert-memory", "50%", "--predictor", "transition", "--learn-maps"], "does not learn online"),
    (["--threads", "999"], "more than this machine's"),
])
def test_options_that_would_do_nothing_are_refused(tiny, capsys, extra, message):
    refused(capsys, ["generate", "--model", str(tiny), "hi", "--quiet", *extra], message)


def test_simulate_json_is_written_whole(trace, tmp_path):
    assert main(["simulate", str(trace), "--capacity", "4,6", "--json", str(tmp_path / "s.json")]) == 0
    assert len(json.loads((tmp_path / "s.json").read_text())["rows"]) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]
    assert np.isfinite([r["hit_rate"] for r in json.loads((tmp_path / "s.json").read_text())["rows"]]).all()


# -- 4. issue 45: one line for every bad input, nothing a user owns lost ------------------------------------------
def test_outputs_the_os_refuses_are_caught_before_any_work(tiny, trace, tmp_path, capsys):
    """/proc exists and passes an access check as root, but takes no new file: each output is probed first."""
    cases = [
        ["quantize", "--model", str(tiny), "--experts", "int8", "--out", "/proc/q"],
        ["export-gguf", "--model", str(tiny), "--out", "/proc/m.gguf"],
        ["make-model", "--preset", "tiny", "--arch", "olmoe", "--out", "/proc/m"],
        ["calibrate", "--model", str(tiny), "--out", "/proc/p.json"],
        ["trace", "convert", "--format", "deepseek-csv", str(tmp_path), "/proc/o.mpt"],
        ["simulate", str(trace), "--plot", "/proc/p.png"],
        ["generate", "--model", str(tiny), "hi", "--stats-json", "/proc/s.json"],
        ["generate", "--model", str(tiny), "hi", "--record-trace", "/proc/t.mpt"],
    ]
    for argv in cases:
        refused(capsys, argv, "cannot write in /proc")


def test_export_gguf_never_replaces_a_file_without_force(tiny, tmp_path, capsys):
    out = tmp_path / "mine.gguf"
    out.write_bytes(b"someone's model")
    refused(capsys, ["export-gguf", "--model", str(tiny), "--out", str(out)], "already exists")
    assert out.read_bytes() == b"someone's model"
    assert main(["export-gguf", "--model", str(tiny), "--out", str(out), "--force"]) == 0
    assert out.read_bytes()[:4] == b"GGUF"


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "{tiny}", "hi", "--seed", str(2**80)], "seed must be an integer in"),
    (["calibrate", "--model", "{tiny}", "--threads", "99"], "more than this machine's"),
    (["chat", "--model", "{tiny}", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["quantize", "--model", "{tiny}", "--experts", "int8", "--int4-group", "64", "--out", "{out}"],
     "apply to --experts int4"),
    (["predictor", "fit", "--kind", "transition", "--trace", "{trace}", "--out", "{out}", "--epochs", "3"],
     "--epochs does nothing for --kind transition"),
    # the newcomer's tracebacks (2026-12-01), each now one line before any work
    (["generate", "--model", "{tiny}", "--prompt-file", "/dev/zero"], "holds more than 64 MiB"),
    (["generate", "--model", "{tiny}", "hi", "--kv-cache-tokens", "1000000000000"], "the KV cache would take"),
    (["generate", "--model", "{tiny}", "hi", "--workers", "1", "--worker-timeout", "nan"],
     "--worker-timeout must be a number of seconds"),
    (["generate", "--model", "{tiny}", "hi", "--workers", "1", "--worker-timeout", "1e309"],
     "--worker-timeout must be a number of seconds"),
    (["generate", "--model", "{tiny}", "hi", "--expert-memory", "25%", "--configure", "auto", "--configure-every",
      "100000000000000000000"], "--configure-every must be at most"),
    (["generate", "--model", "{tiny}", "hi", "--expert-memory", "-5GB"], "is negative"),
    (["generate", "--model", "{tiny}", "hi", "--workers", "100"], "experts a layer, so at most"),
    # chat and serve start their ranks through the same launcher, which refuses before any rank starts
    (["chat", "--model", "{tiny}", "--workers", "100"], "experts a layer, so at most"),
    (["serve", "--model", "{tiny}", "--workers", "2", "--worker-memory", "abc"], "--worker-memory 'abc' is not a size"),
    (["serve", "--model", "{tiny}", "--workers", "-1"], "--workers must be >= 0, got -1"),
    (["generate", "--model", "{tiny}", "hi", "--workers", "2", "--worker-memory", "abc"],
     "--worker-memory 'abc' is not a size"),
    (["generate", "--model", "{tiny}", "--workers", "2"], "give at least one PROMPT"),
    (["generate", "--model", "{tiny}", "hi", "--on-worker-loss", "failover"], "add --workers N"),
    (["generate", "--model", "{tiny}", "hi", "--workers", "1", "--shadow", "--kv-align-period", "-1"],
     "shadow's KV cache is realigned"),
    (["generate", "--model", "{tiny}", "hi", "--worker-prefill", "spread"], "add --workers N"),
    (["generate", "--model", "{tiny}", "hi", "--workers", "1", "--worker-timeout", "0"],
     "--worker-timeout must be a number of seconds in (0, 86400], got 0.0"),
    (["make-model", "--preset", "tiny", "--arch", "olmoe", "--seed", str(10**23), "--out", "{out}"],
     "--seed must be an integer in"),
    (["trace", "convert", "--format", "olmoe-counts", "--layers", "a,b", "{trace}", "{out}"],
     "--layers takes comma-separated layer indices"),
    (["trace", "convert", "--format", "mixtral-raw", "--num-experts", "0", "{trace}", "{out}"],
     "--num-experts must be >= 1"),
    (["trace", "convert", "--format", "mixtral-raw", "--num-experts", "8", "--top-k", "1000", "{trace}", "{out}"],
     "--top-k must be between 1"),
    (["trace", "convert", "--format", "mixtral-raw", "--expert-bytes", "-1", "{trace}", "{out}"],
     "--expert-bytes must be >= 1"),
    (["trace", "convert", "--format", "deepseek-csv", "{binary}", "{out}"], "its bytes are not UTF-8 text"),
    (["simulate", "{dir}"], "is a directory, not a trace file"),
    (["plan", "{trace}", "--expert-memory", "1MB", "--expert-bytes", "-5"], "--expert-bytes must be >= 1"),
])
def test_options_that_make_no_sense_are_refused_in_one_line(tiny, trace, tmp_path, capsys, argv, message):
    binary = tmp_path / "routing.csv"
    binary.write_bytes(bytes(range(256)) * 64)
    fill = {"{tiny}": str(tiny), "{trace}": str(trace), "{out}": str(tmp_path / "out"), "{binary}": str(binary),
            "{dir}": str(tmp_path)}
    refused(capsys, [fill.get(a, a) for a in argv], message)
    assert not (tmp_path / "out").exists()


def test_chat_replaces_bytes_that_are_not_utf8_and_goes_on(tiny):
    run = subprocess.run([sys.executable, "-m", "moepager.cli.main", "chat", "--model", str(tiny), "--quiet",
                          "--temperature", "0", "--max-tokens", "2"], input=b"caf\xe9\n/stats\n/exit\n",
                         capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert b"not valid UTF-8" in run.stderr and b"Traceback" not in run.stderr
    assert b"prompt" in run.stdout  # /stats after the answer: the conversation went on


@pytest.mark.parametrize("edit, message", [
    ({"num_experts_per_tok": 64}, "num_experts_per_tok (64) must be between 1 and the number of experts"),
    ({"num_hidden_layers": -3}, "num_hidden_layers must be a positive integer, got -3"),
    ({"num_hidden_layers": 1}, "holds weights of decoder layers up to"),
    ({"num_attention_heads": 3}, "must be a multiple of num_key_value_heads"),
])
def test_a_config_json_the_architecture_cannot_run_is_refused_by_info_and_generate(tiny, tmp_path, capsys, edit,
                                                                                  message):
    """A config.json edited to values its architecture cannot run (or that would leave the checkpoint's weights
    unused) is refused when read, by every command, in one line; once a run without layers printed text and exit 0."""
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in tiny.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, **edit}))
    refused(capsys, ["generate", "--model", str(bad), "--max-tokens", "2", "hi"], message)
    if "holds weights" not in message:  # (info reads the geometry only, not the weights' names)
        refused(capsys, ["info", "--model", str(bad)], message)
