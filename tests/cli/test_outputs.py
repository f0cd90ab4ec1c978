"""Every command's outputs under one rule (atomic_io.py): an existing file is replaced only with --force; a device or a
pipe (/dev/null, /dev/stdout) is written in place and stays what it was; an output that is one of the command's inputs,
or lies inside an input directory, or holds one, is refused with --force or without; all before any work, in one line
with exit code 2. One test per output option."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from moepager.cli.main import main


@pytest.fixture
def device(tmp_path) -> Path:
    """A character device node like /dev/null (1, 3) in tmp_path (root can make one; else /dev/null itself, which the
    test then only writes to)."""
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        return Path("/dev/null")
    return node


def refused(capsys, argv: list[str], message: str) -> None:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1, err


def commands(tiny: Path, trace: Path, out: str) -> dict[str, list[str]]:
    """Each file output option, writing `out` (`{out}` where a command takes its output as an argument)."""
    return {
        "generate --stats-json": ["generate", "--model", str(tiny), "--max-tokens", "2", "--quiet", "hi",
                                  "--stats-json", out],
        "generate --record-trace": ["generate", "--model", str(tiny), "--max-tokens", "2", "--quiet", "hi",
                                    "--record-trace", out],
        "simulate --json": ["simulate", str(trace), "--capacity", "2", "--policy", "lru", "--json", out],
        "plan --json": ["plan", str(trace), "--expert-memory", "25%", "--json", out],
        "predictor fit --out": ["predictor", "fit", "--kind", "transition", "--trace", str(trace), "--out", out],
        "trace stats --json": ["trace", "stats", str(trace), "--json", out],
        "calibrate --out": ["calibrate", "--model", str(tiny), "--prefill-tokens", "8", "--quiet", "--out", out],
        "export-gguf --out": ["export-gguf", "--model", str(tiny), "--out", out],
    }


OPTIONS = ["generate --stats-json", "generate --record-trace", "simulate --json", "plan --json", "predictor fit --out",
           "trace stats --json", "calibrate --out", "export-gguf --out"]


@pytest.mark.parametrize("option", OPTIONS)
def test_an_existing_file_is_replaced_only_with_force(tiny, trace, tmp_path, capsys, option):
    out = tmp_path / "precious.json"
    out.write_text("precious")
    refused(capsys, commands(tiny, trace, str(out))[option], "already exists; choose another name or pass --force")
    assert out.read_text() == "precious"
    assert main([*commands(tiny, trace, str(out))[option], "--force"]) == 0
    assert out.read_bytes() != b"precious"


@pytest.mark.parametrize("option", OPTIONS)
def test_a_device_is_written_in_place_and_stays_a_device(tiny, trace, capsys, device, option):
    assert main(commands(tiny, trace, str(device))[option]) == 0, capsys.readouterr().err
    assert stat.S_ISCHR(device.stat().st_mode)  # not replaced by a regular file (as root, it once was)


@pytest.mark.parametrize("option, inside", [("generate --stats-json", "config.json"),
                                            ("generate --record-trace", "model.safetensors"),
                                            ("calibrate --out", "profile.json"), ("export-gguf --out", "x.gguf")])
def test_nothing_is_written_into_the_model_it_reads(tiny, trace, capsys, option, inside):
    before = {p.name: p.read_bytes() for p in tiny.iterdir()}
    for extra in ([], ["--force"]):
        refused(capsys, [*commands(tiny, trace, str(tiny / inside))[option], *extra], "this command's input (--model)")
    assert {p.name: p.read_bytes() for p in tiny.iterdir()} == before


@pytest.mark.parametrize("option", ["simulate --json", "plan --json", "predictor fit --out", "trace stats --json"])
def test_a_command_never_writes_over_its_own_input(tiny, trace, capsys, option):
    before = trace.read_bytes()
    refused(capsys, [*commands(tiny, trace, str(trace))[option], "--force"], "is this command's input")
    assert trace.read_bytes() == before


def test_trace_convert_replaces_its_destination_only_with_force_and_never_its_source(tmp_path, capsys):
    src = tmp_path / "routing_raw.jsonl"
    src.write_text('{"layer": 0, "token": 0, "experts": [0, 1]}\n')
    dst = tmp_path / "x.mpt"
    dst.write_text("precious")
    argv = ["trace", "convert", "--format", "mixtral-raw", str(src), str(dst)]
    refused(capsys, argv, "already exists; choose another name or pass --force")
    assert dst.read_text() == "precious"
    refused(capsys, ["trace", "convert", "--format", "mixtral-raw", str(src), str(src), "--force"], "is the source")
    assert src.read_text().startswith('{"layer"')


@pytest.mark.parametrize("command", ["quantize", "split"])
def test_an_out_directory_that_holds_the_model_is_refused_even_with_force(tiny, tmp_path, capsys, command):
    """`quantize --out <the folder above --model> --force` once deleted the source checkpoint and its neighbours."""
    home = tmp_path / "models"
    model = home / "demo"
    model.mkdir(parents=True)
    for p in tiny.iterdir():
        (model / p.name).write_bytes(p.read_bytes())
    (home / "notes.txt").write_text("notes")
    extra = ["--experts", "int8"] if command == "quantize" else ["--parts", "2"]
    for out in (home, model, model / "inner"):
        refused(capsys, [command, "--model", str(model), *extra, "--out", str(out), "--force"],
                "this command's input (--model)")
    assert (home / "notes.txt").read_text() == "notes" and sorted(p.name for p in model.iterdir()) == sorted(
        p.name for p in tiny.iterdir())


def test_simulate_refuses_a_plot_it_cannot_write_before_simulating(trace, tmp_path, capsys):
    refused(capsys, ["simulate", str(trace), "--capacity", "2", "--plot", str(tmp_path / "out.txt")],
            "name a picture file (.png, .pdf, .svg, .jpg, .jpeg)")


def test_stdout_is_written_in_place_after_what_was_printed(tiny, tmp_path):
    """`--stats-json /dev/stdout > file`: the statistics follow the text in the file (appended to what the shell
    opened, not a file renamed over /dev/stdout, nor a truncation of the text before)."""
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        done = subprocess.run([sys.executable, "-m", "moepager.cli.main", "generate", "--model", str(tiny),
                               "--max-tokens", "2", "--quiet", "hi", "--stats-json", "/dev/stdout"], stdout=f,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text.startswith("hi") and '"generated_tokens": 2' in text and os.path.islink("/dev/stdout")
