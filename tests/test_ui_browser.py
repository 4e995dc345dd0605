"""The web page in a real browser (Debian's Chromium, driven by Playwright) against a
real `tandem serve` on 127.0.0.1: it loads without console errors, shows the model and
figures that move under load, streams a chat with each token marked by its source, and
on a keyed server asks for a key and refuses a wrong one.

TANDEM_UI_SCREENSHOT=PATH saves the page under load there (docs/ui.png is made so).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from playwright.sync_api import sync_playwright

from tests.test_process import BLAS_PRELOAD, env_without, running_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
KEY = "ui-test-key-0123456789abcdef"
PROMPT = "def add(a, b):\n    return a + b\n" * 3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser():
    assert os.path.exists(CHROMIUM), "apt-get install chromium"
    # A BLAS preloaded into this process (LD_PRELOAD) crashes Node and Chromium: the
    # driver, and the browser it starts, get the environment without it.
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        driver = sync_playwright().start()
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    browser = driver.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    yield browser
    browser.close()
    driver.stop()


def serve(model_dir, *extra: str):
    # The target drafts for itself: every greedy draft is accepted, so marks are certain.
    args = [str(model_dir), "--served-model-name", "tiny", "--draft-model", str(model_dir)]
    return running_server([*args, *extra], env_without(*BLAS_PRELOAD))


@pytest.fixture(scope="module")
def open_server(tiny_model_dir):
    with serve(tiny_model_dir) as server:
        yield server


@contextmanager
def page_on(browser, url: str, **context_options) -> Iterator:
    """A fresh tab on `url`, with the console errors it logs collected in page.errors."""
    context = browser.new_context(**context_options)
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    page.goto(url)
    try:
        yield page
    finally:
        context.close()


@contextmanager
def load(url: str, streams: int = 3, headers: dict | None = None) -> Iterator[list[int]]:
    """`streams` clients asking for completions back to back until the block ends."""
    stop, done = threading.Event(), [0]

    def client() -> None:
        with httpx.Client(base_url=url, timeout=60, headers=headers) as http:
            i = 0
            while not stop.is_set():
                body = {"prompt": f"{PROMPT}# {i}\n", "max_tokens": 64, "temperature": 0}
                http.post("/v1/completions", json=body).raise_for_status()
                done[0] += 1
                i += 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(streams)]
    for thread in threads:
        thread.start()
    try:
        yield done
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def number(text: str) -> float:
    try:
        return float(text.replace("%", ""))
    except ValueError:
        return 0.0


def test_page_loads_and_figures_move_under_load(browser, open_server):
    with page_on(browser, open_server.url, viewport={"width": 1400, "height": 1000}) as page:
        page.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny'")
        assert page.text_content("#state") == "ready"
        assert page.is_hidden("#key-dialog")
        finished_before = number(page.text_content("[data-field=finished]"))
        seconds = float(os.environ.get("TANDEM_UI_LOAD_SECONDS", "6"))
        with load(open_server.url) as done:
            page.wait_for_function(
                "() => parseFloat(document.querySelector('[data-field=tps]').textContent) > 0",
                timeout=30_000,
            )
            page.wait_for_function(
                "() => parseInt(document.querySelector('[data-field=running]').textContent) > 0",
                timeout=30_000,
            )
            time.sleep(seconds)
            assert page.locator("#chart-tps path.line").count() == 1
            assert page.locator("#methods tbody td").first.text_content() == "draft model"
            shot = os.environ.get("TANDEM_UI_SCREENSHOT")
            if shot:
                chat_once(page, "Write the add function again, with a docstring.\n\n" + PROMPT)
                page.screenshot(path=shot, full_page=True)
        assert done[0] > 0
        page.wait_for_function(
            f"() => parseInt(document.querySelector('[data-field=finished]').textContent) > "
            f"{finished_before}",
            timeout=10_000,
        )
        assert page.errors == []


def chat_once(page, text: str):
    """Send `text` in the chat; the answer's bubble once it has finished streaming."""
    answered = page.locator(".msg.assistant[data-done]").count()
    page.fill("#prompt", text)
    page.click("#send")
    page.wait_for_function(
        f"() => document.querySelectorAll('.msg.assistant[data-done]').length > {answered}",
        timeout=60_000,
    )
    answer = page.locator(".msg.assistant").last
    assert answer.get_attribute("data-done") == "true", answer.text_content()
    return answer


def test_chat_streams_tokens_marked_by_source(browser, open_server):
    with page_on(browser, open_server.url) as page:
        page.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny'")
        answer = chat_once(page, PROMPT)
        drafted = answer.locator(".tok.src-draft")
        target = answer.locator(".tok.src-target")
        assert drafted.count() > 0 and target.count() > 0
        assert answer.locator(".tok").count() == drafted.count() + target.count()
        assert drafted.first.get_attribute("title") == "draft model"
        totals = answer.locator(".totals").text_content()
        assert "tokens" in totals and "accepted" in totals and "tok/s" in totals
        # what people and models write is shown as text, never made markup
        markup = '<img src="x" id="injected"><script>window.injected = 1</script>'
        chat_once(page, markup)
        assert page.locator("#injected").count() == 0
        assert page.locator(".msg.user .bubble").last.text_content() == markup
        assert page.evaluate("() => window.injected") is None
        assert page.errors == []


def test_phone_width_has_no_sideways_scroll(browser, open_server):
    options = {"viewport": {"width": 390, "height": 844}, "is_mobile": True}
    with page_on(browser, open_server.url, **options) as page:
        page.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny'")
        overflow = page.evaluate(
            "document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0
        assert page.errors == []


def test_keyed_server_asks_for_a_key_and_refuses_a_wrong_one(browser, tiny_model_dir):
    with serve(tiny_model_dir, "--api-key", KEY) as server, page_on(browser, server.url) as page:
        page.wait_for_selector("#key-dialog:not(.hidden)")
        assert page.text_content("#model-name") == "…"  # nothing shown without a key
        page.fill("#key-input", "wrong-key-0123456789abcdef")
        page.click("#key-submit")
        page.wait_for_selector("#key-error:not(.hidden)")
        assert page.is_visible("#key-dialog")
        assert page.evaluate("() => sessionStorage.getItem('tandem.apiKey')") is None
        page.fill("#key-input", KEY)
        page.click("#key-submit")
        page.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny'")
        assert page.is_hidden("#key-dialog")
        answer = chat_once(page, PROMPT)
        assert answer.locator(".tok").count() > 0
        page.wait_for_function("() => document.querySelectorAll('#yours tbody tr').length > 0")
        # The only errors are the browser's notes of the refused (401) requests.
        assert all("401" in error for error in page.errors), page.errors
