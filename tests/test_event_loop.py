"""A request's prompt is built (template, tokenizer, grammar) in a worker thread: while
one client's long prompt is being tokenized, the server keeps answering everyone else."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

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


class HeldEncoder:
    """Wraps the tokenizer's encode: text containing MARK waits until the test releases
    it, and records whether the release came (True) or the wait ran out (False)."""

    def __init__(self, encode) -> None:
        self._encode = encode
        self.entered = threading.Event()
        self.release = threading.Event()
        self.released: list[bool] = []

    def __call__(self, text, *args, **kwargs):
        if isinstance(text, str) and MARK in text:
            self.entered.set()
            self.released.append(self.release.wait(HOLD_LIMIT_S))
        return self._encode(text, *args, **kwargs)


@pytest.fixture
def held(scheduler, monkeypatch) -> HeldEncoder:
    hf_tokenizer = scheduler.model_info.tokenizer._tokenizer
    encoder = HeldEncoder(hf_tokenizer.encode)
    monkeypatch.setattr(hf_tokenizer, "encode", encoder)
    return encoder


async def wait_until(event: threading.Event, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not event.is_set():
        assert time.monotonic() < deadline, "the held request never reached the tokenizer"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("surface", sorted(SURFACES))
async def test_other_clients_are_served_while_a_prompt_is_tokenized(client, held, surface):
    path, body = SURFACES[surface]
    slow = asyncio.create_task(client.post(path, json=body))
    await wait_until(held.entered, HOLD_LIMIT_S * 2)
    other = await asyncio.wait_for(client.get("/v1/models"), HOLD_LIMIT_S)
    held.release.set()
    response = await slow
    assert other.status_code == 200
    assert response.status_code == 200, response.text
    assert held.released == [True], "the prompt was tokenized on the event loop, blocking it"
