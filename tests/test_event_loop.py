"""A request's body is decoded and its prompt built (template, tokenizer, grammar) in a
worker thread: while one client's big request is being prepared, the server keeps
answering everyone else."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import server.http
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
