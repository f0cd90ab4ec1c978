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
