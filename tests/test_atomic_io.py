"""atomic_io.py on real file systems: a full one (a 1 MiB tmpfs mounted in the test, as root) keeps the previous file
and leaves no partial one; the up-front space check refuses what cannot fit; a run killed mid-write leaves a partial
that the next run removes; SIGTERM cleans up as Ctrl-C does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moepager.atomic_io import OutputError, atomic_dir, atomic_file, check_file, check_space, writes_in_place
from moepager.cli.main import main


@pytest.fixture
def full_disk(tmp_path) -> Path:
    """A 1 MiB tmpfs at tmp_path/disk (root only: skipped elsewhere)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "moepager-test", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_write_that_fills_the_disk_keeps_the_previous_file_and_leaves_no_partial(full_disk):
    out = full_disk / "stats.json"
    out.write_text("previous")
    with pytest.raises(OSError) as e:
        with atomic_file(out) as tmp:
            tmp.write_bytes(b"x" * (2 << 20))
    assert e.value.errno == 28 and out.read_text() == "previous"
    assert sorted(p.name for p in full_disk.iterdir()) == ["stats.json"]


def test_the_cli_says_a_full_disk_in_one_line_and_keeps_what_was_there(full_disk, capsys):
    out = full_disk / "model.gguf"
    out.write_text("previous")
    assert main(["export-gguf", "--out", str(out), "--force"]) == 2  # the built-in model: 25 MB
    errors = [line[line.index("error:"):] for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"error: export-gguf: the disk is full writing {out}"), errors
    assert out.read_text() == "previous" and sorted(p.name for p in full_disk.iterdir()) == ["model.gguf"]


def test_an_output_that_cannot_fit_is_refused_before_any_work(full_disk, capsys):
    with pytest.raises(OutputError, match="needs 0.10 GB, and 0.00 GB are free"):
        check_space(full_disk, 100_000_000, "make-model --out")
    huge = ["make-model", "--preset", "qwen3-30b-a3b", "--layers", "100000", "--out", str(full_disk / "huge")]
    assert main(huge) == 2
    assert "make-model --out: needs" in capsys.readouterr().err and not any(full_disk.iterdir())


def test_a_partial_left_by_a_killed_run_is_removed_by_the_next(tmp_path, capsys):
    out = tmp_path / "split"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".split.partial-{dead.pid}"
    stale.mkdir()
    (stale / "shard.safetensors").write_bytes(b"x" * 1000)
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text("{}")
    assert not stale.exists() and (out / "config.json").exists()
    assert f"removed {stale}" in capsys.readouterr().err


def test_sigterm_cleans_up_a_partial_output_as_ctrl_c_does(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.Popen([sys.executable, "-m", "moepager.cli.main", "make-model", "--preset", "qwen3-30b-a3b",
                             "--layers", "1", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(tmp_path.glob(".m.partial-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 130, proc.stderr.read()
    assert list(tmp_path.iterdir()) == []


def test_devices_and_pipes_are_written_in_place(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert writes_in_place("/dev/null") and writes_in_place("/dev/stdout") and writes_in_place(fifo)
    assert not writes_in_place(tmp_path / "file.json") and check_file("/dev/null", "--json") == Path("/dev/null")
