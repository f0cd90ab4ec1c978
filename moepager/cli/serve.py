"""`moepager serve [--model PATH] [--host H] [--port P]`: the OpenAI-compatible server and its web page."""

from __future__ import annotations

import argparse
import signal
import threading
import time
from pathlib import Path

from moepager.cli.generate import (
    add_engine_arguments,
    announce_threads,
    engine_config,
    refuse_ignored_engine_options,
)
from moepager.cli.launch import launch_workers, starts_workers
from moepager.errors import MoepagerError
from moepager.experts.remote.placement import Links
from moepager.runtime.llm import LLM

HELP = "serve the model over an OpenAI-compatible HTTP API (completions, chat, streaming) with a live web page"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face checkpoint directory (default: the built-in demo model)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    add_engine_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars and no access log")


def run(args: argparse.Namespace, links: Links = Links()) -> int:
    """`links`: the worker ranks' process groups, on the main rank of a --workers run (distributed/__main__.py)."""
    import uvicorn

    from moepager.server.app import create_app

    if not 0 < args.port < 65536:
        raise MoepagerError(f"--port must be in 1..65535, got {args.port}")
    refuse_ignored_engine_options(args)
    if starts_workers(args):  # start the worker processes: this command runs again as each rank
        return launch_workers(args, engine_config(args))
    llm = LLM(config=engine_config(args), show_progress=not args.quiet, links=links)
    announce_threads(args)
    llm.warm_batched_decode()  # --compile: concurrent requests decode through the compiled step from the first
    name = args.served_model_name or Path(args.model or llm.loaded.checkpoint.path).name  # a GGUF: its file name
    app = create_app(llm, name, engine_thread=False)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           access_log=not args.quiet, timeout_graceful_shutdown=STOP_GRACE_S))
    http = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    http.start()
    while not server.started and http.is_alive():  # announce only once it listens
        time.sleep(0.02)
    if server.started:
        print(f"serving {name} on http://{args.host}:{args.port} (web page at /, OpenAI API at /v1)", flush=True)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops as Ctrl-C does
    try:  # the engine steps on the main thread (see AsyncEngine.start); Ctrl-C lands here and stops both
        app.state.engine.run(until=lambda: not http.is_alive())
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        app.state.engine.shut_down("the server is shutting down")  # running streams end with an error and [DONE]
        server.should_exit = True
        http.join(timeout=STOP_GRACE_S + 5)
    if not server.started:
        raise MoepagerError(f"the server could not listen on {args.host}:{args.port} (in use, or not an address here?)")
    return 0


STOP_GRACE_S = 2
"""Seconds uvicorn waits for open connections once told to stop (the streams have been ended by then)."""


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
