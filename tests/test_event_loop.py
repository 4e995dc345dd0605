"""A request's body is decoded and its prompt built (template, tokenizer, grammar) in a
worker thread: while one client's big request is being prepared, the server keeps
answering everyone else."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

import server.http
from server.json_body import PiecewiseJSONResponse
from tests.conftest import MODEL_NAME

MARK = "hold this prompt"
HOLD_LIMIT_S = 5  # a held build gives up after this, so a regression fails, not hangs

CHAT = [{"role": "user", "content": MARK}]
SURFACES = {
    "chat": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4}),
    "completions": ("/v1/completions", {"prompt": MARK, "max_tokens": 4}),
    "messages": ("/v1/messages", {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4}),
    "responses": ("/v1/responses", {"input": MARK, "max_output_tokens": 4}),
    "count_tokens": ("/v1/messages/count_tokens", {"model": MODEL_NAME, "messages": CHAT}),
}


class Held:
    """Wraps a function: a call whose first argument contains MARK waits until the test
    releases it, and records whether the release came (True) or the wait ran out."""

    def __init__(self, function) -> None:
        self._function = function
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released: list[bool] = []

    def __call__(self, first, *args, **kwargs):
        needle = MARK if isinstance(first, str) else MARK.encode()
        if needle in first:
            self.entered.set()
            self.released.append(self.release.wait(HOLD_LIMIT_S))
        return self._function(first, *args, **kwargs)


@pytest.fixture(params=["decode_body", "tokenize"])
def held(request, scheduler, monkeypatch) -> Held:
    """Holds either the body's JSON decoding or the prompt's tokenizing."""
    if request.param == "decode_body":
        target, name = server.http, "decode_body"
    else:
        target, name = scheduler.model_info.tokenizer._tokenizer, "encode"
    wrapper = Held(getattr(target, name))
    monkeypatch.setattr(target, name, wrapper)
    return wrapper


async def wait_until(event: threading.Event, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not event.is_set():
        assert time.monotonic() < deadline, "the held request never reached the held step"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("surface", sorted(SURFACES))
async def test_other_clients_are_served_while_a_request_is_prepared(client, held, surface):
    path, body = SURFACES[surface]
    slow = asyncio.create_task(client.post(path, json=body))
    await wait_until(held.entered, HOLD_LIMIT_S * 2)
    other = await asyncio.wait_for(client.get("/v1/models"), HOLD_LIMIT_S)
    held.release.set()
    response = await slow
    assert other.status_code == 200
    assert response.status_code == 200, response.text
    assert held.released == [True], "the held step ran on the event loop, blocking it"


# --- response assembly ---------------------------------------------------------------

LONG_PROMPT = "def add(a, b):\n    return a + b\n" * 110  # ~1.8k tokens
ASSEMBLED = {
    "completions": (
        "/v1/completions",
        {"prompt": LONG_PROMPT, "max_tokens": 64, "echo": True, "logprobs": 20},
    ),
    "chat": (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 64, "logprobs": True, "top_logprobs": 20},
    ),
    "responses": ("/v1/responses", {"input": MARK, "max_output_tokens": 64}),
}


class HeldOnce:
    """Wraps a function: its first call waits until the test releases it (or the wait
    runs out), recording which; later calls run straight through."""

    def __init__(self, function) -> None:
        self._function = function
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released: list[bool] = []

    def __call__(self, *args, **kwargs):
        if not self.entered.is_set():
            self.entered.set()
            self.released.append(self.release.wait(HOLD_LIMIT_S))
        return self._function(*args, **kwargs)


def hold_assembly(surface: str, monkeypatch) -> HeldOnce:
    """Holds the first step of building a finished response: naming a logprob's token
    (completions, chat) or parsing the output into items (responses)."""
    if surface == "responses":
        from server.output_parser import OutputParser

        held = HeldOnce(OutputParser.step)
        monkeypatch.setattr(OutputParser, "step", lambda self, *a: held(self, *a))
        return held
    import server.openai.logprobs

    held = HeldOnce(server.openai.logprobs.token_text)
    monkeypatch.setattr(server.openai.logprobs, "token_text", held)
    return held


@pytest.mark.parametrize("surface", sorted(ASSEMBLED))
async def test_other_clients_are_served_while_a_response_is_assembled(client, monkeypatch, surface):
    path, body = ASSEMBLED[surface]
    held = hold_assembly(surface, monkeypatch)
    slow = asyncio.create_task(client.post(path, json={**body, "temperature": 0}))
    await wait_until(held.entered, HOLD_LIMIT_S * 2)
    other = await asyncio.wait_for(client.get("/health"), HOLD_LIMIT_S)
    held.release.set()
    response = await slow
    assert other.status_code == 200
    assert response.status_code == 200, response.text
    assert held.released == [True], "the response was assembled on the event loop"


async def largest_stall(task: asyncio.Task, tick_s: float = 0.002) -> float:
    """The longest the event loop went without running a ticker, until `task` ends."""
    worst, last = 0.0, time.perf_counter()
    while not task.done():
        await asyncio.sleep(tick_s)
        now = time.perf_counter()
        worst, last = max(worst, now - last - tick_s), now
    return worst


async def test_echo_with_top20_logprobs_does_not_stall_the_loop(client):
    """~1.8k echoed prompt tokens and 20 alternatives each: about 38k token names to
    decode and a 2 MB JSON body, built while other clients keep being served. Built on
    the loop this stalls it 300-450 ms every time; off it, 10-20 ms. The better of two
    runs is taken, so another process busy on a shared CI box does not fail the test."""
    path, body = ASSEMBLED["completions"]
    stalls = []
    for _ in range(2):
        slow = asyncio.create_task(client.post(path, json={**body, "temperature": 0}))
        stalls.append(await largest_stall(slow))
        response = await slow
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"][0]["logprobs"]["tokens"]) > 1500
    assert min(stalls) < 0.1, f"the event loop stalled for {min(stalls) * 1000:.0f} ms"


def test_piecewise_json_is_byte_identical_to_json_dumps():
    logprobs = {
        "tokens": [f't{i}\u00e9"' for i in range(300)],
        "token_logprobs": [None, *(-i / 7 for i in range(299))],
        "top_logprobs": [None, *({f"a{j}": -j / 3 for j in range(20)} for _ in range(299))],
        "text_offset": list(range(300)),
    }
    body = {"id": "x", "choices": [{"index": 0, "logprobs": logprobs}], "usage": {"n": 1}}
    for value in (body, [], {}, "text", list(range(200)), {str(i): [i] for i in range(100)}):
        expected = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        assert PiecewiseJSONResponse(value).body == expected.encode("utf-8")
