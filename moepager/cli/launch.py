"""Rank processes on this machine for `--workers` (generate, serve, chat): this command again as the main rank, its
workers and a shadow, each process outliving the others (so a lost worker can be failed over), and each ended with
the launcher."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from moepager.checkpoints.default import default_model_path
from moepager.config import Budget, EngineConfig
from moepager.errors import MoepagerError
from moepager.loading.build import read_config

RANKS_PER_CORE = 4
"""--workers: at most this many rank processes per CPU core (beyond, each waits on the others' time slices)."""


def starts_workers(args: argparse.Namespace) -> bool:
    """`--workers N` on the command a user typed, not on a rank the launcher started: this process starts the ranks."""
    return bool(args.workers) and "RANK" not in os.environ


def launch_workers(args: argparse.Namespace, config: EngineConfig, interactive: bool = False) -> int:
    """`--workers N` (generate, serve, chat; the command has checked its own options): this command again as the main,
    N worker (and a shadow) processes (`moepager.distributed`); the main process's exit status. `config`: the engine's
    configuration every rank builds from these options. `interactive` (chat): Ctrl-C is the main process's (it stops
    an answer, not the program)."""
    check_workers(args, config)
    cmd = [sys.executable, "-m", "moepager.distributed", *args.argv]  # argv starts with the command, generate
    return spawn_ranks(cmd, args.workers + 1 + args.shadow, args.worker_timeout, interactive=interactive)[0]


def check_workers(args: argparse.Namespace, config: EngineConfig) -> None:
    """What every rank would check, checked once here before any rank starts (a rank's error would otherwise reach
    the user as another rank's lost connection): the model, each worker's budget, and the rank count against what the
    machine and the model allow."""
    cfg = read_config(args.model or default_model_path())  # (read_config resolves a GGUF file's path)
    if args.workers > cfg.num_experts:
        raise MoepagerError(f"--workers {args.workers}: the model has {cfg.num_experts} experts a layer, so at most "
                            f"{cfg.num_experts} workers hold any")
    world, cores = args.workers + 1 + args.shadow, os.cpu_count() or 1
    if world > RANKS_PER_CORE * cores:
        raise MoepagerError(f"--workers {args.workers} starts {world} processes on {cores} cores; at most "
                            f"{RANKS_PER_CORE * cores} ({RANKS_PER_CORE} a core) run usefully here")
    if config.remote.worker_memory is not None:
        Budget.parse(config.remote.worker_memory, "--worker-memory")


def spawn_ranks(cmd: list[str], world: int, stop_timeout_s: float, env: dict[str, str] | None = None,
                quiet: bool = False, main_timeout_s: float | None = None, interactive: bool = False) -> list[int]:
    """`cmd` as `world` processes on this machine, torch.distributed's environment set as torchrun sets it but each
    process outliving the others (so a lost worker can be failed over); every exit status, rank 0's first (waited for
    up to `main_timeout_s`). The others get `stop_timeout_s` to end after rank 0 has, then are killed. Only rank 0
    reads this process's input; `interactive`: Ctrl-C is rank 0's alone (see `_wait_for_main`)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    environ = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
               **(env or {})}
    sink = subprocess.DEVNULL if quiet else None
    procs = [subprocess.Popen(cmd, env={**environ, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=sink, stderr=sink,
                              stdin=None if r == 0 else subprocess.DEVNULL, preexec_fn=_end_with_parent)
             for r in range(world)]
    codes = [_wait_for_main(procs[0], main_timeout_s, stop_timeout_s, interactive)]
    for p in procs[1:]:
        try:
            codes.append(p.wait(timeout=stop_timeout_s))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def _end_with_parent() -> None:
    """In a rank process (Linux): SIGTERM when the launcher dies, even by SIGKILL, so no server keeps its port."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _wait_for_main(main: subprocess.Popen, timeout_s: float | None, stop_timeout_s: float,
                   interactive: bool = False) -> int:
    """Rank 0's exit status. On Ctrl-C (which the terminal sends every process of the command: the other ranks ignore
    it, rank 0 stops them, distributed/roles.py) or SIGTERM here (passed on to rank 0 as Ctrl-C), rank 0 gets
    `stop_timeout_s` more to end before it is killed. `interactive` (chat, where Ctrl-C stops an answer): Ctrl-C is
    left to rank 0, and SIGTERM here is passed on to it as SIGTERM."""
    import signal

    def terminate(signum: int, frame: object) -> None:
        main.send_signal(signal.SIGTERM if interactive else signal.SIGINT)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminate)
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN) if interactive else None
    try:
        return main.wait(timeout=timeout_s)
    except KeyboardInterrupt:
        try:
            return main.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            main.kill()
            return main.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)
