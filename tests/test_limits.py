"""The rate limit as an ASGI middleware on its own: who a bucket belongs to, and
that the buckets stay bounded whatever clients put in their headers."""

from __future__ import annotations

from server.auth import ApiKeyMiddleware
from server.limits import RateLimit


async def ok(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def status_of(app, headers: dict[str, str], client: str = "10.0.0.1") -> int:
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        "client": (client, 50000),
    }
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"]


async def test_rotating_unchecked_key_headers_neither_bypass_the_limit_nor_grow_memory():
    limit = RateLimit(ok, per_minute=5, on_refused=lambda: None)
    codes = [await status_of(limit, {"x-api-key": f"made-up-{i}"}) for i in range(10_000)]
    assert codes.count(200) == 5
    assert len(limit.buckets) == 1


async def test_buckets_stay_bounded_over_many_client_addresses():
    limit = RateLimit(ok, per_minute=5, on_refused=lambda: None)
    for i in range(10_000):
        assert await status_of(limit, {}, client=f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}") == 200
    assert len(limit.buckets) <= limit.buckets.max_buckets < 10_000


def test_a_bucket_idle_long_enough_to_refill_is_dropped():
    limit = RateLimit(ok, per_minute=5, on_refused=lambda: None)
    assert limit.allow("a", now=0.0) == 0
    assert limit.allow("b", now=30.0) == 0
    assert limit.allow("b", now=61.0) == 0
    assert set(limit.buckets) == {"b"}, "a's bucket was full again, so it is forgotten"


async def test_authenticated_keys_get_a_bucket_each():
    app = ApiKeyMiddleware(
        RateLimit(ok, per_minute=2, on_refused=lambda: None), keys=("key-a", "key-b")
    )
    a = [await status_of(app, {"authorization": "Bearer key-a"}) for _ in range(3)]
    b = [await status_of(app, {"x-api-key": "key-b"}) for _ in range(3)]
    assert a == b == [200, 200, 429]
    assert [await status_of(app, {"x-api-key": f"wrong-{i}"}) for i in range(3)] == [401] * 3
