"""`moepager chat [--model PATH]`: an interactive chat in the terminal with the model's chat template.

Answers stream as they are generated; the history is kept across turns (`/reset` forgets it, `/stats` prints
the last answer's statistics, `/exit` or Ctrl-D quits). Ctrl-C stops the answer being written, not the program: the
answer ends after the step then running (a step is never cut in the middle, so worker processes of `--workers` are
never left mid-call).
"""

from __future__ import annotations

import argparse
import io
import signal
import sys
import threading
from collections.abc import Callable

from moepager.cli.generate import (
    add_engine_arguments,
    add_sampling_arguments,
    announce_threads,
    engine_config,
    refuse_ignored_engine_options,
    sampling_params,
    utf8,
)
from moepager.cli.launch import launch_workers, starts_workers
from moepager.errors import InvalidRequestError, MoepagerError
from moepager.experts.remote.placement import Links
from moepager.runtime.llm import LLM
from moepager.runtime.request import Request

HELP = "chat with the model in the terminal (streaming; /reset, /stats, /exit; Ctrl-C stops an answer)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face checkpoint directory (default: the built-in demo model)")
    p.add_argument("--system", help="a system message opening the conversation")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per answer (default 256)")
    add_sampling_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


class Chat:
    """The conversation: messages so far, and one answer at a time streamed from the engine."""

    def __init__(self, llm: LLM, args: argparse.Namespace):
        self.llm, self.args = llm, args
        self.system = [{"role": "system", "content": args.system}] if args.system else []
        self.messages: list[dict[str, str]] = list(self.system)
        self.last: Request | None = None
        """The last answer's request (its statistics)."""

    def reset(self) -> None:
        self.messages = list(self.system)

    def answer(self, text: str, write: Callable[[str], object] = sys.stdout.write) -> str:
        """Stream the model's answer to `text`; Ctrl-C ends it early, after the step then running (what was written
        is kept)."""
        self.messages.append({"role": "user", "content": text})
        ids = self.llm.encode_chat(self.messages)
        context = self.llm.loaded.config.max_position_embeddings
        if len(ids) >= context:
            self.messages.pop()
            raise InvalidRequestError(f"the conversation is {len(ids)} tokens, over the model's context of {context}: "
                                      f"/reset to start again")
        params = sampling_params(self.args, min(self.args.max_tokens, context - len(ids)))
        engine = self.llm.engine
        request = engine.new_request(ids, params, stream=True, grow_kv=True)
        engine.add(request)
        stop = threading.Event()
        on_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, lambda *_: stop.set()) if on_main else None
        try:
            for outputs in engine.drain():
                for out in outputs:
                    if out.new_text:
                        write(out.new_text)
                        sys.stdout.flush()
                if stop.is_set():
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            engine.abort(request.request_id)
            list(engine.drain())
            write(" [stopped]")
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        if not request.text.text and not stop.is_set():  # (the model ended its answer at once: say so)
            write("(empty answer)")
        self.messages.append({"role": "assistant", "content": request.text.text})
        self.last = request
        return request.text.text

    def stats(self) -> str:
        request = self.last
        if request is None:
            return "no answer yet"
        s, n = request.stats, len(request.out_ids)
        tpot = s.tpot_s
        rate = f"{len(tpot) / sum(tpot):.1f} tok/s" if tpot and sum(tpot) else "n/a"
        return (f"prompt {len(request.prompt_ids)} tokens, answer {n} tokens, TTFT {1e3 * (s.ttft_s or 0):.0f} ms, "
                f"decode {rate}, history {len(self.messages)} messages")



def read_line() -> str:
    """One line of input (with the terminal's line editing); bytes that are not UTF-8 are replaced, with a warning
    (as generate's prompts are), so a stray byte never ends the conversation."""
    if isinstance(sys.stdin, io.TextIOWrapper) and sys.stdin.errors != "surrogateescape":
        sys.stdin.reconfigure(errors="surrogateescape")  # undecodable bytes reach us, as lone surrogates
    line = input("> ")
    return utf8(line.encode("utf-8", "surrogateescape"), "this message")

def run(args: argparse.Namespace, links: Links = Links()) -> int:
    """`links`: the worker ranks' process groups, on the main rank of a --workers run (distributed/__main__.py)."""
    if args.max_tokens < 1:
        raise MoepagerError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    refuse_ignored_engine_options(args)
    if starts_workers(args):  # start the worker processes; this command runs again as rank 0
        return launch_workers(args, engine_config(args), interactive=True)
    llm = LLM(config=engine_config(args), show_progress=not args.quiet, links=links)
    announce_threads(args)
    if llm.tokenizer is None or not llm.tokenizer.chat_template:
        raise MoepagerError("this checkpoint has no chat template (tokenizer_config.json chat_template); use generate")
    chat = Chat(llm, args)
    print("moepager chat — /reset forgets the conversation, /stats, /exit; Ctrl-C stops an answer", flush=True)
    while True:
        try:
            line = read_line()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        command = line.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            chat.reset()
            print("(conversation forgotten)")
        elif command == "/stats":
            print(chat.stats())
        elif command:
            try:
                chat.answer(line)
            except InvalidRequestError as e:
                print(f"error: {e}")
            print(flush=True)
