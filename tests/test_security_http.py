"""The HTTP edge against a hostile client on the same network: slow and idle
connections, Content-Type and Host checks, key guessing, keys that cannot work,
refused-request log volume, and what the server reveals about itself.

Socket behaviour is tested against real `tandem serve` processes on 127.0.0.1; the
rest against the app in process."""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server.app import create_app
from server.auth import ApiKeyMiddleware
from server.cli import build_parser
from server.config import ServerConfig
from server.serve import build_config
from tests.conftest import MODEL_NAME, make_client
from tests.test_process import env_without, running_server

KEY = "a-key-long-enough-to-pass-0123"
HI = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": HI, "max_tokens": 1},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
    "/v1/messages": {"messages": HI, "max_tokens": 1},
    "/v1/messages/count_tokens": {"messages": HI},
}


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_type(path: str, response: httpx.Response) -> str:
    """The error's type in the path's own API shape (asserting the shape)."""
    body = response.json()
    if is_anthropic(path):
        assert body["type"] == "error", body
    else:
        assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]["type"]


def client_at(app, address: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(address, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60)


def config_for(*argv: str) -> ServerConfig:
    args = build_parser().parse_args(["serve", "/models/some-model", *argv])
    return build_config(args)


# --- Content-Type -------------------------------------------------------------------------


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
async def test_post_body_that_is_not_declared_json_gets_415_in_its_api_shape(
    scheduler, path, content_type
):
    """A web page can send these without a CORS preflight; application/json it cannot."""
    headers = {"content-type": content_type} if content_type else {}
    async with make_client(scheduler) as client:
        body = httpx.Request("POST", "/", json=BODIES[path]).content
        response = await client.post(path, content=body, headers=headers)
    assert response.status_code == 415, response.text
    assert error_type(path, response) == "invalid_request_error"


@pytest.mark.parametrize("path", list(BODIES))
async def test_json_content_type_with_charset_is_accepted(scheduler, path):
    async with make_client(scheduler) as client:
        body = httpx.Request("POST", "/", json=BODIES[path]).content
        headers = {"content-type": "Application/JSON; charset=utf-8"}
        response = await client.post(path, content=body, headers=headers)
    assert response.status_code == 200, response.text


# --- Host ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", "/v1/messages"])
async def test_keyless_server_refuses_a_foreign_host_with_421(scheduler, path):
    """DNS rebinding: the attacker's page names its own domain as Host."""
    async with make_client(scheduler, allowed_hosts=()) as client:
        method = "GET" if path == "/v1/models" else "POST"
        headers = {"host": "rebind.attacker.example"}
        response = await client.request(method, path, json=BODIES.get(path), headers=headers)
    assert response.status_code == 421, response.text
    assert error_type(path, response) in ("invalid_request_error", "permission_error")


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000", "192.168.1.20:8000"]
)
async def test_keyless_server_answers_loopback_names_and_ip_addresses(scheduler, host):
    async with make_client(scheduler, allowed_hosts=()) as client:
        response = await client.get("/v1/models", headers={"host": host})
    assert response.status_code == 200, response.text


async def test_allowed_hosts_adds_names_and_subdomains(scheduler):
    async with make_client(scheduler, allowed_hosts=("box.lan", ".example.org")) as client:
        codes = {
            host: (await client.get("/v1/models", headers={"host": host})).status_code
            for host in ("box.lan:8000", "example.org", "a.example.org", "box.lan.evil", "x.lan")
        }
    assert codes == {
        "box.lan:8000": 200,
        "example.org": 200,
        "a.example.org": 200,
        "box.lan.evil": 421,
        "x.lan": 421,
    }


def test_cli_checks_host_without_keys_and_not_with_them():
    assert config_for().allowed_hosts == ()
    assert config_for("--api-key", KEY).allowed_hosts == ("*",)
    assert config_for("--allowed-hosts", "box.lan, .example.org").allowed_hosts == (
        "box.lan",
        ".example.org",
    )


# --- failed keys --------------------------------------------------------------------------


async def test_wrong_keys_from_one_address_get_429_after_a_burst(scheduler):
    app = create_app(
        ServerConfig(scheduler=scheduler.config, served_model_name=MODEL_NAME, api_keys=(KEY,)),
        scheduler,
    )
    burst = ApiKeyMiddleware.FAILURES_BURST
    async with client_at(app, "10.0.0.1") as guesser, client_at(app, "10.0.0.2") as other:
        codes = [
            (await guesser.get("/v1/models", headers={"x-api-key": f"guess-{i}"})).status_code
            for i in range(burst + 5)
        ]
        assert codes == [401] * burst + [429] * 5
        # Even a right guess is refused while the address is limited: no oracle.
        right = await guesser.get("/v1/models", headers={"x-api-key": KEY})
        assert right.status_code == 429 and int(right.headers["retry-after"]) >= 1
        anthropic = await guesser.post("/v1/messages", json=BODIES["/v1/messages"])
        assert anthropic.status_code == 429
        assert error_type("/v1/messages", anthropic) == "rate_limit_error"
        # Another address is not affected.
        assert (await other.get("/v1/models", headers={"x-api-key": KEY})).status_code == 200
        assert (await other.get("/v1/models")).status_code == 401


async def test_key_check_refuses_websocket_scopes():
    """A WebSocket route added later is not open by default."""
    reached = []

    async def inner(scope, receive, send) -> None:
        reached.append(scope["type"])

    sent = []

    async def send(message) -> None:
        sent.append(message)

    async def receive():
        return {"type": "websocket.connect"}

    app = ApiKeyMiddleware(inner, keys=(KEY,))
    scope = {"type": "websocket", "path": "/v1/stream", "headers": [], "client": ("10.0.0.3", 1)}
    await app(scope, receive, send)
    assert reached == [] and sent == [{"type": "websocket.close", "code": 1008}]
    await app({"type": "lifespan"}, receive, send)
    assert reached == ["lifespan"]


# --- keys at startup ----------------------------------------------------------------------


def test_key_file_skips_comments_and_blank_lines(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# team keys\n\n  # an indented comment\n   \n  {KEY}  \n#{KEY}x\n")
    assert config_for("--api-key-file", str(keys)).api_keys == (KEY,)


@pytest.mark.parametrize(
    ("key", "reason"),
    [("x", "one character"), ("clé-secrète-assez-longue", "printable ASCII"), ("a\tb", "ASCII")],
)
def test_unusable_keys_are_refused_at_startup_without_echoing_them(key, reason):
    with pytest.raises(SystemExit) as refused:
        config_for("--api-key", KEY, "--api-key", key)
    message = str(refused.value)
    assert "#2" in message and reason in message and key not in message


def test_a_short_key_is_accepted_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert config_for("--api-key", "short-key").api_keys == ("short-key",)
    assert re.search(r"API key #1 is 9 characters long; use at least 16", caplog.text)
    assert "short-key" not in caplog.text


# --- what the server reveals --------------------------------------------------------------


async def test_models_list_reports_the_served_name_not_a_path(scheduler, tiny_model_dir):
    async with make_client(scheduler) as client:
        response = await client.get("/v1/models")
    assert response.status_code == 200
    assert response.json()["data"][0]["root"] == MODEL_NAME
    assert str(tiny_model_dir) not in response.text


async def test_trailing_slash_redirect_is_relative_whatever_the_host(scheduler):
    async with make_client(scheduler) as client:
        response = await client.get("/v1/models/?x=1", headers={"host": "evil.example"})
        assert response.status_code == 307
        assert response.headers["location"] == "/v1/models?x=1"
        assert (await client.get("/no/such/path/")).status_code == 404
        outside = await client.get("//evil.example/")  # "/" (the web page) under that Host
        assert outside.status_code == 200 and "location" not in outside.headers


# --- body read time (in process) ----------------------------------------------------------


async def test_a_body_that_stops_arriving_gets_408_in_its_api_shape(scheduler):
    async def stalled_body():
        yield b'{"messages": '
        await asyncio.sleep(30)
        yield b"[]}"

    async with make_client(scheduler, body_timeout=0.5) as client:
        for path in ("/v1/chat/completions", "/v1/messages"):
            started = time.monotonic()
            response = await client.post(
                path, content=stalled_body(), headers={"content-type": "application/json"}
            )
            assert response.status_code == 408, response.text
            assert response.headers["connection"] == "close"
            assert error_type(path, response) in ("invalid_request_error", "timeout_error")
            assert time.monotonic() - started < 5


# --- real server processes ----------------------------------------------------------------

MAX_CONNECTIONS = 300


@pytest.fixture(scope="module")
def keyless(tiny_model_dir):
    """A keyless server as the CLI starts it, with a low connection cap and a short
    body timeout; the header timeout is the default."""
    args = [
        str(tiny_model_dir),
        "--served-model-name",
        "tiny",
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--body-timeout",
        "1",
    ]
    with running_server(args, env_without("TANDEM_API_KEY")) as server:
        yield server


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=30)


def seconds_until_closed(sock: socket.socket, limit: float) -> float:
    """How long until the server closes `sock` (reads EOF), or `limit` if it does not."""
    started = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return limit
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return time.monotonic() - started


def test_idle_and_half_sent_requests_are_closed_within_ten_seconds(keyless):
    idle = connect(keyless)
    half = connect(keyless)
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    with ThreadPoolExecutor(2) as pool:
        waited = list(pool.map(lambda s: seconds_until_closed(s, 20), [idle, half]))
    assert all(w < 11.5 for w in waited), waited


def test_a_body_that_never_finishes_is_refused_and_closed(keyless):
    sock = connect(keyless)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    sock.sendall(head.encode() + b'{"prompt": ')
    started = time.monotonic()
    sock.settimeout(10)
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert time.monotonic() - started < 5


def test_health_answers_fast_with_500_idle_sockets_held(keyless):
    held = [connect(keyless) for _ in range(500)]
    try:
        started = time.monotonic()
        response = httpx.get(f"{keyless.url}/health", timeout=5)
        elapsed = time.monotonic() - started
        assert response.status_code == 200 and elapsed < 1, elapsed
        # Over the cap the longest idle were evicted: the server holds no more than it may.
        time.sleep(0.5)
        still_open = 0
        for sock in held:
            sock.setblocking(False)
            try:
                still_open += sock.recv(1) != b""
            except BlockingIOError:
                still_open += 1
        assert still_open <= MAX_CONNECTIONS, still_open
    finally:
        for sock in held:
            sock.close()


def test_more_idle_sockets_than_file_descriptors_do_not_take_the_server_down(keyless):
    """mlx-lm sets the open-file limit to 2048 (hard 4096) at import, in the server and
    here: past it, accepting fails (EMFILE) and asyncio stops accepting for a second."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held = []
    try:
        for _ in range(2200):
            held.append(connect(keyless))
        started = time.monotonic()
        response = httpx.get(f"{keyless.url}/health", timeout=10)
        assert response.status_code == 200 and time.monotonic() - started < 1
        assert "Too many open files" not in keyless.log()
    finally:
        for sock in held:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_cli_server_without_keys_checks_host_and_content_type(keyless):
    url = f"{keyless.url}/v1/completions"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    rebound = httpx.post(url, json=body, headers={"host": "rebind.attacker.example"})
    assert rebound.status_code == 421
    plain = httpx.post(url, content=httpx.Request("POST", url, json=body).content)
    assert plain.status_code == 415
    assert httpx.post(url, json=body, headers={"host": "localhost"}, timeout=30).status_code == 200


def test_keyed_server_answers_any_host_and_logs_refusals_at_a_bounded_rate(tiny_model_dir):
    args = [str(tiny_model_dir), "--served-model-name", "tiny", "--api-key", KEY]
    with running_server(args, env_without("TANDEM_API_KEY")) as server:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            headers = {"host": "tandem.box.example", "x-api-key": KEY}
            assert client.get("/v1/models", headers=headers).status_code == 200
            codes = [client.get("/v1/models").status_code for _ in range(60)]
        assert set(codes) == {401, 429}
        time.sleep(0.5)
        refused_lines = re.findall(r'"GET /v1/models HTTP/1.1" (?:401|429)', server.log())
        assert 1 <= len(refused_lines) <= 12, len(refused_lines)
