"""Entry point: parse the command line, run one command, turn user errors into one line and exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import metadata

from moepager.accel import cpu_tiers
from moepager.cli import (
    calibrate,
    chat,
    export_gguf,
    generate,
    info,
    make_model,
    plan,
    predict_eval,
    predictor,
    quantize,
    serve,
    simulate,
    split,
    trace,
)
from moepager.errors import MoepagerError

COMMANDS = {"generate": generate, "serve": serve, "chat": chat, "info": info, "make-model": make_model,
            "simulate": simulate, "plan": plan, "trace": trace, "predictor": predictor, "predict-eval": predict_eval,
            "calibrate": calibrate, "quantize": quantize, "split": split, "export-gguf": export_gguf}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line, exit 2, like ours
        self.exit(2, f"error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moepager", description="Run Mixture-of-Experts LLMs that do not fit in memory.")
    parser.add_argument("--version", action="version", version=f"moepager {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def _version() -> str:
    try:
        return metadata.version("moepager")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    """The command line as given (`generate --workers` runs it again under torchrun)."""
    try:
        cpu_tiers.requested()  # a MOEPAGER_CPU_TIER this CPU cannot run is refused before any work
        return COMMANDS[args.command].run(args)
    except MoepagerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`moepager info | head`): stop quietly, as other tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
