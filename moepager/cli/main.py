"""Entry point: parse the command line, run one command, turn user errors into one line and exit code 2 (and, as the
last resort, any other error too: its traceback only with MOEPAGER_DEBUG=1)."""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
import traceback
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


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


DEBUG_ENV = "MOEPAGER_DEBUG"
"""Set to 1 to see the traceback of an unexpected error beside its one line."""


def unexpected(command: str, error: BaseException) -> str:
    """The one line for an error no check foresaw: the command, what the error says (and the file it names)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" writing {error.filename}" if error.filename else ""
        return (f"error: {command}: the disk is full{where} ({error.strerror}); what was being written was removed "
                "and what was there before is kept: free space, or write elsewhere")
    if isinstance(error, OSError) and error.strerror:
        where = f" ({error.filename})" if error.filename else ""
        what = f"{error.strerror}{where}"
    else:
        what = " ".join(str(error).split()) or type(error).__name__
    what = what if len(what) <= 300 else what[:297] + "..."
    return (f"error: {command} failed unexpectedly: {type(error).__name__}: {what} (set {DEBUG_ENV}=1 for the "
            "traceback)")


SIZE_OPTIONS = ("--expert-memory", "--host-memory", "--worker-memory")
"""Options whose value may be written with a sign (a negative size), which argparse would take for an option."""


def _joined(argv: list[str]) -> list[str]:
    """`--expert-memory -5GB` as `--expert-memory=-5GB`: argparse then hands the value to the budget's own check
    ("is negative") instead of saying "expected one argument"."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in SIZE_OPTIONS and arg[:1] == "-" and arg[1:2].isdigit():
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    given = _joined(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(given)
    args.argv = given
    """The command line as given (`generate --workers` runs it again under torchrun)."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupted)  # SIGTERM stops as Ctrl-C does: partial outputs are removed
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
    except Exception as e:  # the last resort: what no check caught is still one line and exit code 2
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            traceback.print_exc()
        print(unexpected(args.command, e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
