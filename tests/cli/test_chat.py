"""`moepager chat`: streaming answers with history, /reset and /stats, and Ctrl-C stopping only the answer."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from moepager.cli.chat import Chat, add_arguments
from moepager.cli.generate import engine_config
from moepager.runtime.llm import LLM


@pytest.fixture(scope="module")
def chat_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--temperature", "0", "--max-tokens", "12", "--quiet"])


@pytest.fixture(scope="module")
def llm(chat_args):
    return LLM(config=engine_config(chat_args), show_progress=False)


def test_answers_stream_and_the_history_grows_until_reset(llm, chat_args):
    chat = Chat(llm, chat_args)
    pieces: list[str] = []
    first = chat.answer("Tell me about the sea.", pieces.append)
    assert "".join(pieces) == first
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    second = chat.answer("And rivers?", lambda _: None)
    prompt = llm.tokenizer.apply_chat_template(chat.messages[:3])
    assert "Tell me about the sea." in prompt and first in prompt  # the second turn saw the first
    assert second and "answer" in chat.stats() and "history 4 messages" in chat.stats()
    chat.reset()
    assert chat.messages == [] and chat.answer("Tell me about the sea.", lambda _: None) == first


def test_ctrl_c_stops_the_answer_not_the_chat(llm, chat_args):
    chat = Chat(llm, chat_args)
    written: list[str] = []

    def interrupt_after_first_piece(text: str) -> None:
        written.append(text)
        if len(written) == 1:
            raise KeyboardInterrupt
    partial = chat.answer("Tell me about the sea.", interrupt_after_first_piece)
    assert written[:1] == [partial] and written[-1] == " [stopped]"
    assert not llm.engine.has_work() and len(llm.engine.pool.free) == llm.engine.pool.num_blocks - 1
    assert chat.answer("And rivers?", lambda _: None)  # the chat goes on


def test_the_command_reads_turns_and_commands_from_its_input():
    run = subprocess.run([sys.executable, "-m", "moepager.cli.main", "chat", "--temperature", "0", "--max-tokens", "8",
                          "--quiet"], input="Hello there\n/stats\n/reset\n/stats\n/exit\n", capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "prompt" in run.stdout and "answer" in run.stdout and "(conversation forgotten)" in run.stdout
