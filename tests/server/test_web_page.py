"""The web page in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright): a chat answer
streams in, and the live panel shows the engine's numbers while it generates. Marked `browser`: the default
suite leaves it out; run it with `pytest -m browser` where Chromium and the 'browser' extra are installed."""

from __future__ import annotations

import os
import shutil

import pytest

from moepager.config import EngineConfig, StoreConfig
from moepager.runtime.llm import LLM

from .conftest import live_server

pytestmark = pytest.mark.browser
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip("no Chromium at /usr/bin/chromium (Debian package 'chromium')")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


def test_the_page_streams_a_chat_answer_and_shows_the_engine_live(browser, tmp_path):
    paged = EngineConfig(store=StoreConfig(expert_memory="50%", direct_io="off"))
    with live_server(LLM(config=paged, show_progress=False)) as url:
        page = browser.new_page()
        page.goto(url)
        page.wait_for_function("document.getElementById('model').textContent === 'demo-moe'", timeout=15_000)
        page.fill("#max_tokens", "48")
        page.fill("#prompt", "Tell me about the sea.")
        page.click("#send")
        page.wait_for_selector(".msg.assistant[data-done='true']", timeout=60_000)
        answer = page.inner_text(".msg.assistant")
        assert answer.strip() and not answer.startswith("error")
        page.wait_for_function("Number(document.getElementById('gen').textContent) > 0", timeout=15_000)
        assert page.inner_text("#placement") == "paged"
        assert page.locator("#layers .bar").count() == 6  # one bar per MoE layer of the built-in model
        assert page.inner_text("#disk") != "0 B"
        page.screenshot(path=os.environ.get("MOEPAGER_SCREENSHOT", str(tmp_path / "page.png")))
        # A second turn carries the history, and the answer streams into a new bubble.
        page.fill("#prompt", "And the rivers?")
        page.click("#send")
        page.wait_for_function("document.querySelectorAll(\".msg.assistant[data-done='true']\").length === 2",
                               timeout=60_000)
        page.close()


def opened(browser, url: str):
    """A new page on the server, loaded (the model's name shown), and the bodies of the chat requests it sends
    (recorded as it sends them)."""
    import json

    page, sent = browser.new_page(), []
    page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.url.endswith("/v1/chat/completions")
            else None)
    page.goto(url)
    page.wait_for_function("document.getElementById('model').textContent === 'demo-moe'", timeout=15_000)
    return page, sent


def say(page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def wait_answers(page, n: int) -> None:
    page.wait_for_function(f"document.querySelectorAll(\".msg[data-done='true']\").length >= {n}", timeout=60_000)


def test_a_failed_turn_leaves_the_conversation_and_an_empty_field_means_the_default(browser):
    """A turn the server refuses (temperature -1) shows its error, scrolled into view, and is not sent again with the
    next turn; an emptied max-tokens field sends no max_tokens (it once sent 0, refused)."""
    with live_server(LLM(show_progress=False)) as url:
        page, sent = opened(browser, url)
        page.fill("#temperature", "-1")
        say(page, "hello")
        wait_answers(page, 1)
        assert page.inner_text(".msg.error").startswith("error: temperature must be >= 0")
        assert page.evaluate("(() => { const log = document.getElementById('log'); "
                             "return log.scrollTop + log.clientHeight >= log.scrollHeight - 1; })()")
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "")
        say(page, "The history of")
        wait_answers(page, 2)
        assert not page.inner_text(".msg.assistant:last-child").startswith("error")
        assert sent[-1]["messages"] == [{"role": "user", "content": "The history of"}]
        assert "max_tokens" not in sent[-1] and sent[-1]["temperature"] == 0
        page.close()


def test_new_chat_mid_answer_drops_that_answer_and_a_stopped_answer_is_marked(browser):
    with live_server(LLM(show_progress=False)) as url:
        page, sent = opened(browser, url)
        page.fill("#max_tokens", "2000")
        say(page, "Tell me a long story.")
        page.wait_for_function("document.querySelector('.msg.assistant').textContent.length > 5", timeout=60_000)
        page.click("#stop")
        wait_answers(page, 1)
        assert "[stopped]" in page.inner_text(".msg.assistant")
        say(page, "Go on.")
        page.wait_for_function("document.querySelectorAll('.msg.assistant').length === 2 && "
                               "document.querySelectorAll('.msg.assistant')[1].textContent.length > 5",
                               timeout=60_000)
        assert [m["role"] for m in sent[-1]["messages"]] == ["user", "assistant", "user"]
        page.click("#reset")  # mid-answer: the answer is dropped, and belongs to no chat
        page.fill("#max_tokens", "8")
        say(page, "Hello again.")
        wait_answers(page, 1)
        assert sent[-1]["messages"] == [{"role": "user", "content": "Hello again."}]
        page.wait_for_timeout(500)
        assert page.locator(".msg").count() == 2  # the new chat's turn and answer only
        page.close()
