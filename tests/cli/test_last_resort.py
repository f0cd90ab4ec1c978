"""The last resort (cli/main.py): an error that no check foresaw, raised past every command's validation, is one line
naming the command and what failed, with exit code 2; its traceback only with MOEPAGER_DEBUG=1. Every subcommand of
the frozen CLI surface is run so, with a fault injected where its work begins."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from moepager.cli.main import main

SURFACE = Path(__file__).with_name("cli_surface.txt")


def cases(tiny: Path, trace: Path, tmp: Path) -> dict[str, tuple[str, list[str]]]:
    """Subcommand -> (the function its work starts with, patched to fail; a command line that reaches it)."""
    model = ["--model", str(tiny)]
    return {
        "generate": ("moepager.runtime.llm.LLM.generate", ["generate", *model, "--quiet", "hi"]),
        "serve": ("moepager.server.app.create_app", ["serve", *model, "--quiet", "--port", "18971"]),
        "chat": ("moepager.cli.chat.Chat", ["chat", *model, "--quiet"]),
        "info": ("moepager.cli.info.architecture_for", ["info", *model]),
        "make-model": ("moepager.loading.synth._write_checkpoint", ["make-model", "--preset", "tiny", "--arch",
                                                                       "mixtral", "--out", str(tmp / "m")]),
        "simulate": ("moepager.cli.simulate.simulate", ["simulate", str(trace), "--capacity", "2"]),
        "plan": ("moepager.cli.plan.layer_costs", ["plan", str(trace), "--expert-memory", "25%"]),
        "trace info": ("moepager.cli.trace.TraceReader", ["trace", "info", str(trace)]),
        "trace stats": ("moepager.cli.trace.routing_stats", ["trace", "stats", str(trace)]),
        "trace convert": ("moepager.cli.trace.convert", ["trace", "convert", "--format", "mixtral-raw", str(trace),
                                                         str(tmp / "x.mpt")]),
        "predictor fit": ("moepager.cli.predictor.TraceReader", ["predictor", "fit", "--kind", "transition",
                                                                    "--trace", str(trace), "--out", str(tmp / "p")]),
        "predict-eval": ("moepager.cli.predict_eval.evaluate", ["predict-eval", "--trace", str(trace), "--predictor",
                                                                "transition"]),
        "calibrate": ("moepager.cli.calibrate.calibrate", ["calibrate", *model, "--quiet"]),
        "quantize": ("moepager.cli.quantize.quantize_checkpoint", ["quantize", *model, "--experts", "int8", "--out",
                                                                   str(tmp / "q")]),
        "split": ("moepager.cli.split.split_checkpoint", ["split", *model, "--out", str(tmp / "s")]),
        "export-gguf": ("moepager.cli.export_gguf.export_gguf", ["export-gguf", *model, "--out", str(tmp / "x.gguf")]),
    }


def subcommands() -> set[str]:
    """The subcommands of tests/cli/cli_surface.txt ("moepager trace convert: ..." -> "trace convert")."""
    names = set()
    for line in SURFACE.read_text().splitlines():
        head = line.split(":", 1)[0].split()[1:]
        if head:
            names.add(" ".join(head))
    return names


def test_the_cases_cover_every_subcommand_of_the_cli_surface(tmp_path):
    assert set(cases(Path("m"), Path("t"), tmp_path)) == subcommands()


@pytest.mark.parametrize("name", sorted(subcommands()))
@pytest.mark.parametrize("fault", [RuntimeError("injected fault\n  on two lines"),
                                   OSError(errno.ENOSPC, "No space left on device", "/full/disk/file")])
def test_a_fault_past_validation_is_one_line_with_exit_code_2(tiny, trace, tmp_path, capsys, monkeypatch, name,
                                                              fault):
    target, argv = cases(tiny, trace, tmp_path)[name]

    def broken(*args: object, **kwargs: object) -> None:
        raise fault

    monkeypatch.setattr(target, broken)
    monkeypatch.delenv("MOEPAGER_DEBUG", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    command = argv[0]
    if isinstance(fault, RuntimeError):
        assert err == (f"error: {command} failed unexpectedly: RuntimeError: injected fault on two lines (set "
                       "MOEPAGER_DEBUG=1 for the traceback)")
    else:
        assert err.startswith(f"error: {command}: the disk is full writing /full/disk/file (No space left on device)")


def test_moepager_debug_shows_the_traceback_too(tiny, capsys, monkeypatch):
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr("moepager.cli.info.architecture_for", broken)
    monkeypatch.setenv("MOEPAGER_DEBUG", "1")
    assert main(["info", "--model", str(tiny)]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().endswith("for the traceback)")
