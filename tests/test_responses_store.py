"""What the Responses store keeps and for whom: OpenAI's metadata limits on every
surface that takes `metadata`, a store bounded by bytes as well as by count, and
stored responses visible only to the API key that made them."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess

import httpx
import pytest

from server.app import create_app
from server.config import ServerConfig
from server.responses.store import ResponseStore, StoredResponse
from tests.conftest import MODEL_NAME, make_client

MB = 1 << 20
KEY_ONE, KEY_TWO = "first-key-0123456789", "second-key-0123456789"
SHORT = {"model": MODEL_NAME, "max_output_tokens": 2, "temperature": 0}


def app_client(scheduler, **overrides) -> tuple[httpx.AsyncClient, object]:
    config = ServerConfig(scheduler=scheduler.config, served_model_name=MODEL_NAME, **overrides)
    app = create_app(config, scheduler)
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://tandem.test", timeout=60), app


def full_metadata() -> dict[str, str]:
    return {f"{i:02d}".ljust(64, "k"): "v" * 512 for i in range(16)}


def maximal_body(limit: int) -> dict:
    """The largest body the server accepts whose size is not bounded by the model's
    context: full metadata and tools that are sent but not rendered (tool_choice none)."""
    tool_text = (limit - 64 * 1024) // 16
    tools = [
        {"type": "function", "name": f"tool_{i}", "description": "d" * tool_text} for i in range(16)
    ]
    body = {**SHORT, "input": "Hi", "tools": tools, "tool_choice": "none"}
    return {**body, "metadata": full_metadata()}


def resident_bytes() -> int:
    """This process's resident memory once the garbage collector and the C allocator
    have given back what is free: glibc keeps freed heap pages (from parsing 4 MB
    bodies in worker threads) mapped, which is reuse, not growth."""
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only
    if trim is not None:
        trim(0)
    pid = str(os.getpid())
    rss = subprocess.run(["ps", "-o", "rss=", "-p", pid], capture_output=True, text=True)
    return int(rss.stdout) * 1024


# --- metadata limits --------------------------------------------------------------------

OVER_LIMIT = {
    "17 pairs": {f"k{i}": "v" for i in range(17)},
    "65-char key": {"k" * 65: "v"},
    "513-char value": {"k": "v" * 513},
}
OPENAI_SURFACES = {
    "responses": ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    ),
}


@pytest.mark.parametrize("surface", sorted(OPENAI_SURFACES))
@pytest.mark.parametrize("case", sorted(OVER_LIMIT))
async def test_over_limit_metadata_is_400_in_openai_shape(scheduler, surface, case):
    path, body = OPENAI_SURFACES[surface]
    async with make_client(scheduler) as http:
        reply = await http.post(path, json={**body, "metadata": OVER_LIMIT[case]})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith("metadata")


@pytest.mark.parametrize("surface", sorted(OPENAI_SURFACES))
async def test_metadata_at_the_limits_is_accepted(scheduler, surface):
    path, body = OPENAI_SURFACES[surface]
    async with make_client(scheduler) as http:
        reply = await http.post(path, json={**body, "metadata": full_metadata()})
    assert reply.status_code == 200, reply.text
    if surface == "responses":
        assert reply.json()["metadata"] == full_metadata()


async def test_anthropic_metadata_user_id_is_bounded(scheduler):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    async with make_client(scheduler) as http:
        fine = await http.post("/v1/messages", json={**body, "metadata": {"user_id": "u" * 256}})
        long = await http.post("/v1/messages", json={**body, "metadata": {"user_id": "u" * 257}})
    assert fine.status_code == 200, fine.text
    assert long.status_code == 400, long.text
    assert long.json()["type"] == "error"
    assert long.json()["error"]["type"] == "invalid_request_error"


# --- the store's size -------------------------------------------------------------------


async def test_twenty_maximal_responses_stay_within_50_mb(scheduler):
    http, app = app_client(scheduler)
    body = maximal_body(ServerConfig.max_body_bytes)
    async with http:
        first = await http.post("/v1/responses", json=body)  # warms allocator and caches
        assert first.status_code == 200, first.text[:300]
        before = resident_bytes()
        ids = []
        for _ in range(20):
            reply = await http.post("/v1/responses", json=body)
            assert reply.status_code == 200, reply.text[:300]
            ids.append(reply.json()["id"])
        grown = resident_bytes() - before
        store = app.state.responses_store
        assert grown < 50 * MB, f"RSS grew by {grown / MB:.0f} MB"
        assert store.bytes <= ServerConfig.responses_store_bytes < 50 * MB
        newest = await http.get(f"/v1/responses/{ids[-1]}")
        assert newest.status_code == 200
        assert newest.json()["metadata"] == full_metadata()
        assert (await http.get(f"/v1/responses/{ids[0]}")).status_code == 404  # evicted


async def test_store_evicts_the_oldest_past_its_byte_bound(scheduler):
    http, app = app_client(scheduler, responses_store_bytes=MB)
    padding = {"type": "function", "name": "pad", "description": "p" * (300 * 1024)}
    body = {**SHORT, "tools": [padding], "tool_choice": "none"}
    async with http:
        ids = []
        for i in range(5):
            reply = await http.post("/v1/responses", json={**body, "input": f"Turn {i}"})
            ids.append(reply.json()["id"])
        store = app.state.responses_store
        assert 0 < store.bytes <= MB
        found = [(await http.get(f"/v1/responses/{i}")).status_code for i in ids]
    assert found == [404, 404, 200, 200, 200]


# --- scoped by API key ------------------------------------------------------------------


def as_key(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_another_key_cannot_see_continue_or_delete_a_response(scheduler):
    async with make_client(scheduler, api_keys=(KEY_ONE, KEY_TWO)) as http:
        made = await http.post(
            "/v1/responses",
            json={**SHORT, "input": "Hi", "instructions": "secret plan"},
            headers=as_key(KEY_ONE),
        )
        assert made.status_code == 200, made.text
        rid = made.json()["id"]
        other = as_key(KEY_TWO)
        got = await http.get(f"/v1/responses/{rid}", headers=other)
        deleted = await http.delete(f"/v1/responses/{rid}", headers=other)
        follow = await http.post(
            "/v1/responses",
            json={**SHORT, "input": "Go on", "previous_response_id": rid},
            headers=other,
        )
        assert [got.status_code, deleted.status_code, follow.status_code] == [404, 404, 404]
        assert "secret plan" not in got.text + deleted.text + follow.text
        assert follow.json()["error"]["param"] == "previous_response_id"
        mine = as_key(KEY_ONE)
        assert (await http.get(f"/v1/responses/{rid}", headers=mine)).status_code == 200
        continued = await http.post(
            "/v1/responses",
            json={**SHORT, "input": "Go on", "previous_response_id": rid},
            headers=mine,
        )
        assert continued.status_code == 200, continued.text
        assert (await http.delete(f"/v1/responses/{rid}", headers=mine)).status_code == 200


def test_the_scope_holding_the_most_gives_up_its_oldest_entry():
    """Fair-share eviction: a key that fills the store evicts its own oldest responses,
    not another key's; by bytes, the scope holding the most bytes pays; one scope alone
    is a plain LRU; the entry just stored is never the one evicted."""
    entry = StoredResponse(b"[]", b"{}")
    store = ResponseStore(capacity=4)
    store.put("a", "a1", entry)
    for i in range(6):
        store.put("b", f"b{i}", entry)
    assert store.get("a", "a1") is not None
    assert [store.get("b", f"b{i}") is not None for i in range(6)] == [False] * 3 + [True] * 3
    alone = ResponseStore(capacity=2)
    for i in range(3):
        alone.put("a", f"a{i}", entry)
    assert [alone.get("a", f"a{i}") is not None for i in range(3)] == [False, True, True]
    big = StoredResponse(b"[]", b"{" + b" " * 98 + b"}")  # 102 bytes
    by_bytes = ResponseStore(capacity=10, max_bytes=250)
    by_bytes.put("a", "small", entry)
    by_bytes.put("b", "big1", big)
    by_bytes.put("b", "big2", big)  # 208 bytes held: a fits beside b's two
    by_bytes.put("a", "big", big)  # 310: b holds the most bytes and gives up big1
    assert by_bytes.get("b", "big1") is None
    assert all(by_bytes.get(*key) for key in (("a", "small"), ("b", "big2"), ("a", "big")))
