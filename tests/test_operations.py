"""Operations against real `tandem serve` processes on 127.0.0.1: keys, limits,
disconnects, timeouts, fault isolation, hostile input and graceful drain."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.test_process import TANDEM, ServerProcess, env_without, running_server

PROMPT = "Once upon a time"


def clean_env(**extra: str) -> dict[str, str]:
    """No key from the environment unless a test sets one."""
    return env_without("TANDEM_API_KEY", **extra)


def completion(url: str, headers: dict | None = None, **payload) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, **payload}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=60)


def metric(url: str, name: str, headers: dict | None = None) -> float:
    text = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


@pytest.fixture(scope="module")
def limited(tiny_model_dir, tmp_path_factory):
    """A keyed server with small limits and the fault hook."""
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text("# keys\nfile-key\n")
    with running_server(
        [
            str(tiny_model_dir),
            "--served-model-name",
            "tiny",
            "--api-key",
            "flag-key",
            "--api-key-file",
            str(key_file),
            "--max-tokens",
            "64",
            "--max-body-bytes",
            "65536",
            "--max-num-seqs",
            "2",
            "--max-queue",
            "1",
            "--inject-fault-on",
            "FAULT",
            "--request-timeout",
            "20",
        ],
        clean_env(TANDEM_API_KEY="env-key"),
    ) as server:
        yield server


AUTH = {"Authorization": "Bearer flag-key"}


def test_keys_none_wrong_right_both_header_styles(limited):
    url = limited.url
    assert httpx.get(f"{url}/health").status_code == 200
    assert completion(url).status_code == 401
    assert completion(url, {"Authorization": "Bearer wrong"}).status_code == 401
    assert completion(url, {"x-api-key": "wrong"}).status_code == 401
    for headers in (
        {"Authorization": "Bearer flag-key"},
        {"x-api-key": "file-key"},
        {"Authorization": "Bearer env-key"},
    ):
        assert completion(url, headers).status_code == 200, headers
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/v1/models").json()["error"]["type"] == "authentication_error"


def test_limits_give_documented_codes(limited):
    url = limited.url
    # Asking beyond --max-tokens is served up to it and ends with a length reason.
    capped = completion(url, AUTH, max_tokens=65, ignore_eos=True).json()
    assert capped["usage"]["completion_tokens"] == 64
    assert capped["choices"][0]["finish_reason"] == "length"
    assert completion(url, AUTH, n=2).status_code == 400
    assert completion(url, AUTH, prompt=[5] * 2100).json()["error"]["code"] == (
        "context_length_exceeded"
    )
    big = httpx.post(f"{url}/v1/completions", content=b"x" * 70000, headers=AUTH, timeout=30)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"


def test_queue_bound_gives_503_with_retry_after(limited):
    url = limited.url
    results: list[httpx.Response] = []

    def long_request() -> None:
        results.append(completion(url, AUTH, max_tokens=64, ignore_eos=True))

    threads = [threading.Thread(target=long_request) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) >= 3 and 503 in codes, codes
    refused = next(r for r in results if r.status_code == 503)
    assert refused.headers["retry-after"]


def test_forced_fault_fails_only_that_request(limited):
    url = limited.url
    outcome: dict[str, httpx.Response] = {}

    def run(name: str, prompt: str) -> None:
        outcome[name] = completion(url, AUTH, prompt=prompt, max_tokens=40, ignore_eos=True)

    threads = [
        threading.Thread(target=run, args=(n, p))
        for n, p in (("bad", "FAULT please"), ("good", PROMPT))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcome["bad"].status_code == 500
    assert outcome["bad"].json()["error"]["type"] == "server_error"
    assert outcome["good"].status_code == 200
    assert outcome["good"].json()["usage"]["completion_tokens"] == 40
    assert httpx.get(f"{url}/health").status_code == 200
    # The fault fires wherever the bad request's fourth token is committed: in a batched
    # step, in a speculative step, or while it is handed over between the two.
    limited.wait_for_log(
        r"request cmpl-\w+ failed (in the batched engine|while being handed over)"
        r"|engine step failed"
    )
    assert completion(url, AUTH).status_code == 200


def test_disconnect_frees_the_slot(limited):
    url = limited.url
    payload = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, headers=AUTH) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i > 4:
                break
    deadline = time.monotonic() + 10
    while metric(url, "vllm:num_requests_running", AUTH) != 0:
        assert time.monotonic() < deadline, "the cancelled request kept its slot"
        time.sleep(0.05)
    assert metric(url, "tandem_client_disconnects_total", AUTH) >= 1


HOSTILE = [
    ("huge number", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}", 400),
    ("huge float", b'{"prompt": "hi", "temperature": 1e400}', 400),
    ("deep nesting", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    ("invalid utf-8", b'{"prompt": "\xff\xfe\xfa"}', 400),
    ("not json", b"prompt=hi", 400),
    ("form-encoded, declared json", b"prompt=hi&max_tokens=1", 400),
    ("empty body", b"", 400),
    ("null", b"null", 400),
    ("nan", b'{"prompt": "hi", "temperature": NaN}', 400),
    ("lone surrogate", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),
]


@pytest.mark.parametrize(("name", "body", "status"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_gets_4xx_and_server_survives(limited, name, body, status):
    headers = {**AUTH, "content-type": "application/json"}
    response = httpx.post(
        f"{limited.url}/v1/chat/completions", content=body, headers=headers, timeout=30
    )
    assert response.status_code == status, (name, response.text)
    assert "error" in response.json()
    assert httpx.get(f"{limited.url}/health").status_code == 200


def test_ten_megabyte_body_is_refused_quickly(limited):
    started = time.monotonic()
    response = httpx.post(
        f"{limited.url}/v1/completions", content=b"{" + b" " * (10 << 20), headers=AUTH, timeout=60
    )
    assert response.status_code == 413
    assert time.monotonic() - started < 10


def test_request_timeout_aborts_cleanly(tiny_model_dir):
    args = [str(tiny_model_dir), "--served-model-name", "tiny", "--request-timeout", "0.3"]
    with running_server([*args, "--max-tokens", "2000"], clean_env()) as server:
        response = completion(server.url, max_tokens=1900, ignore_eos=True)
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "request_timeout"
        payload = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 1900,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{server.url}/v1/completions", json=payload) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert "timed out" in lines[-2] and lines[-1] == "data: [DONE]"
        assert completion(server.url, max_tokens=5).status_code == 200


def test_non_loopback_bind_without_key_is_refused(tiny_model_dir):
    result = subprocess.run(
        [TANDEM, "serve", str(tiny_model_dir), "--host", "0.0.0.0", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert result.returncode != 0
    assert "refusing to listen on 0.0.0.0 without an API key" in result.stderr


def test_rate_limit_gives_429(tiny_model_dir):
    args = [str(tiny_model_dir), "--served-model-name", "tiny", "--rate-limit", "3"]
    with running_server(args, clean_env()) as server:
        codes = [completion(server.url, max_tokens=1).status_code for _ in range(5)]
        assert codes[:3] == [200, 200, 200] and codes[3:] == [429, 429]
        refused = completion(server.url, max_tokens=1)
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"


def stream_in_thread(url: str, max_tokens: int, sink: list) -> threading.Thread:
    def run() -> None:
        payload = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        sink.append(line)
        except httpx.TransportError:
            sink.append("CUT")  # only the forced exit may cut a stream

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def wait_for_first_line(sink: list, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not sink:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def streaming_server(model_dir, *flags: str) -> tuple[ServerProcess, list[str], threading.Thread]:
    """A `tandem serve` with one long completion stream under way."""
    server = ServerProcess(
        [str(model_dir), "--served-model-name", "tiny", "--max-tokens", "2000", *flags],
        clean_env(),
    )
    server.wait_healthy()
    sink: list[str] = []
    thread = stream_in_thread(server.url, 1990, sink)
    wait_for_first_line(sink)
    return server, sink, thread


def test_sigterm_drains_in_flight_stream_to_done_and_exits_zero(tiny_model_dir):
    server, sink, thread = streaming_server(tiny_model_dir)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    refused = completion(server.url)
    assert refused.status_code == 503
    assert httpx.get(f"{server.url}/health").status_code == 503
    thread.join(60)
    assert sink[-1] == "data: [DONE]"
    final = json.loads(sink[-2][len("data: ") :])
    assert final["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(30) == 0
    server.log_file.close()


def test_drain_timeout_aborts_with_error_event_and_exits_zero(tiny_model_dir):
    server, sink, thread = streaming_server(tiny_model_dir, "--shutdown-timeout", "0.5")
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    thread.join(60)
    assert sink[-1] == "data: [DONE]"
    assert "shutting down" in json.loads(sink[-2][len("data: ") :])["error"]["message"]
    assert server.proc.wait(30) == 0
    assert time.monotonic() - started < 15
    server.log_file.close()


def test_second_signal_exits_at_once(tiny_model_dir):
    server, sink, thread = streaming_server(tiny_model_dir, "--shutdown-timeout", "60")
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    server.proc.wait(15)
    assert time.monotonic() - started < 10
    thread.join(30)
    assert sink[-1] == "CUT", "the forced exit does not wait for the stream"
    server.log_file.close()
