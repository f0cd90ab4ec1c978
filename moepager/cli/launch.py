"""Rank processes on this machine for `--workers` (generate, serve, chat): this command again as the main rank, its
workers and a shadow, each process outliving the others (so a lost worker can be failed over), and each ended with
the launcher."""

from __future__ import annotations

import os
import subprocess
import sys


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
