"""The command-line surface, frozen: every command and subcommand with every option, its choices and whether it
takes a value. A change to the surface is deliberate: regenerate the file with
`python -m tests.cli.test_cli_surface > tests/cli/cli_surface.txt` and let the diff show it in review."""

from __future__ import annotations

import argparse
from pathlib import Path

from moepager.cli.main import build_parser

SURFACE = Path(__file__).with_name("cli_surface.txt")


def describe(parser: argparse.ArgumentParser, prefix: str = "moepager") -> list[str]:
    lines = []
    for action in parser._actions:  # argparse keeps no public list of a parser's arguments
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                lines += describe(sub, f"{prefix} {name}")
            continue
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        takes = "flag" if action.nargs == 0 else f"nargs={action.nargs}" if action.nargs is not None else "value"
        choices = f" choices={','.join(map(str, action.choices))}" if action.choices else ""
        lines.append(f"{prefix}: {name} {takes}{choices}")
    return lines


def test_the_command_line_surface_is_the_frozen_one():
    assert describe(build_parser()) == SURFACE.read_text().splitlines()


if __name__ == "__main__":
    print("\n".join(describe(build_parser())))
