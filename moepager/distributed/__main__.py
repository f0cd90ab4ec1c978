"""`torchrun --nproc-per-node N -m moepager.distributed generate|serve|chat [its options]`: `moepager generate` (or
`serve`, `chat`) on rank 0 with its routed experts on the other N-1 ranks (`--workers`, set from the world size;
distributed/roles.py)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from moepager.cli import chat, generate, serve
from moepager.cli.main import build_parser
from moepager.config import EngineConfig
from moepager.distributed.roles import launch
from moepager.errors import MoepagerError
from moepager.experts.remote.placement import Links

COMMANDS = {"generate": generate, "serve": serve, "chat": chat}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print("usage: torchrun --nproc-per-node N -m moepager.distributed generate [options] PROMPT...\n"
              "       torchrun --nproc-per-node N -m moepager.distributed serve [options]\n"
              "       torchrun --nproc-per-node N -m moepager.distributed chat [options]", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    args.argv = argv

    def on_main(config: EngineConfig, links: Links) -> int:
        args.workers = config.remote.workers
        return COMMANDS[argv[0]].run(args, links)

    try:
        return launch(generate.engine_config(args), on_main)
    except MoepagerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
