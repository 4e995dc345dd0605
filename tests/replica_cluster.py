"""The replica cluster tests/test_replicas.py runs: two `tandem serve` replicas and a
real nginx on 127.0.0.1 running deploy/nginx-replicas.conf, and the helpers that drive
and observe them (which replica served, its metrics, streams, the load-test command)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.single_stream import free_port
from tests.test_deploy import DEPLOY
from tests.test_process import TANDEM, ServerProcess, env_without

NGINX_CONF = DEPLOY / "nginx-replicas.conf"
PROMETHEUS_CONF = DEPLOY / "prometheus-replicas.yml"
DASHBOARD = DEPLOY / "grafana-dashboard.json"
# What the shipped files name, which the tests replace (and nothing else).
SHIPPED_REPLICAS = ("127.0.0.1:8001", "127.0.0.1:8002")
SHIPPED_LISTEN = "listen 8000;"
SHIPPED_LOG_DIR = "/var/log/nginx/"

SESSION = "X-Session-Affinity"
REPLICA = "X-Tandem-Replica"
KEY = "replica-test-key-0123456789"
METRICS_KEY = "replica-scrape-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}

# What Debian's /etc/nginx/nginx.conf gives a conf.d/ file, in a private prefix: the shipped
# file is included in http {} as it is there, with several workers (Debian's `auto`). Workers
# of a root master run as `nobody`, which could not reach pytest's private tmp dirs; as root
# they run as root instead.
MAIN_CONF = """\
worker_processes 2;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log info;
{user}
events {{
    worker_connections 256;
}}
http {{
    sendfile on;
    tcp_nopush on;
    gzip on;
    default_type application/octet-stream;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    include {prefix}/tandem.conf;
}}
"""


def nginx_binary() -> str:
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        message = "nginx is not installed (apt-get install nginx; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def balancer_conf(replicas: list[str], port: int, log_dir: Path) -> str:
    """deploy/nginx-replicas.conf with only its ports and its log directory replaced."""
    text = NGINX_CONF.read_text()
    assert text.count(SHIPPED_LISTEN) == 1, "the test rewrites one `listen 8000;`"
    text = text.replace(SHIPPED_LISTEN, f"listen 127.0.0.1:{port};")
    for shipped, replica in zip(SHIPPED_REPLICAS, replicas, strict=True):
        text = text.replace(f"server {shipped} ", f"server {replica} ")
    assert not re.search(r"server 127\.0\.0\.1:800\d", text), "a replica line was not rewritten"
    return text.replace(SHIPPED_LOG_DIR, f"{log_dir}/")


class Balancer:
    """nginx in the foreground with a private prefix: no root-owned path is touched."""

    def __init__(self, replicas: list[str], prefix: Path) -> None:
        binary = nginx_binary()
        prefix.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (prefix / "tandem.conf").write_text(balancer_conf(replicas, self.port, prefix))
        user = "user root;" if os.geteuid() == 0 else ""
        (prefix / "nginx.conf").write_text(MAIN_CONF.format(prefix=prefix, user=user))
        self.stderr = (prefix / "stderr.log").open("w")
        self.proc = subprocess.Popen(
            [binary, "-p", str(prefix), "-c", str(prefix / "nginx.conf")]
            + ["-e", str(prefix / "error.log"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
        )

    def wait_listening(self, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"nginx exited:\n{self.logs()}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"nginx not listening in {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text()}"
            for name in ("stderr.log", "error.log", "tandem.access.log")
            if (path := self.prefix / name).exists()
        )

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def address(replica: ServerProcess) -> str:
    """How nginx names a replica (X-Tandem-Replica, the access log, Prometheus' label)."""
    return f"127.0.0.1:{replica.port}"


@dataclass
class Cluster:
    replicas: list[ServerProcess]
    balancer: Balancer
    _keys: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.balancer.url

    @property
    def addresses(self) -> list[str]:
        return [address(replica) for replica in self.replicas]

    def session_key(self, replica: ServerProcess) -> str:
        """A session header value the balancer's consistent hash sends to `replica` (the
        ring depends on the replicas' addresses, which are free ports)."""
        for i in range(64):
            if address(replica) in self._keys:
                break
            key = f"conversation-{i}"
            response = httpx.get(f"{self.url}/v1/models", headers={**AUTH, SESSION: key})
            assert response.status_code == 200, response.text
            self._keys.setdefault(response.headers[REPLICA], key)
        return self._keys[address(replica)]


def replica_args(model_dir: Path) -> list[str]:
    return [
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--api-key",
        KEY,
        "--metrics-api-key",
        METRICS_KEY,
        "--max-num-seqs",
        "2",  # a third request queues: the unbuffered-streaming test relies on it
        "--max-tokens",
        "2000",
        "--shutdown-timeout",
        "60",
    ]


@contextmanager
def running_cluster(model_dir: Path, prefix: Path) -> Iterator[Cluster]:
    """Two healthy replicas and nginx in front of them, all stopped when the block ends."""
    nginx_binary()
    # One BLAS thread each: two replicas share this machine's cores.
    env = env_without("TANDEM_API_KEY", OPENBLAS_NUM_THREADS="1")
    replicas = [ServerProcess(replica_args(model_dir), env) for _ in range(2)]
    balancer = None
    try:
        for replica in replicas:
            replica.wait_healthy()
        balancer = Balancer([address(replica) for replica in replicas], prefix)
        balancer.wait_listening()
        yield Cluster(replicas, balancer)
    finally:
        if balancer is not None:
            balancer.stop()
        for replica in replicas:
            replica.stop()


def metric(replica: ServerProcess, name: str) -> float:
    """`name` summed over its labels, read from the replica itself (not the balancer)."""
    text = httpx.get(f"{replica.url}/metrics", headers=AUTH, timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def chat_body(content: str, max_tokens: int, **extra) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def post_chat(cluster: Cluster, session: str | None = None, max_tokens: int = 4):
    headers = {**AUTH, SESSION: session} if session else AUTH
    body = chat_body("Once upon a time", max_tokens)
    return httpx.post(f"{cluster.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


class Stream:
    """A streamed chat completion through the balancer, read to its end in a thread."""

    def __init__(self, cluster: Cluster, session: str, max_tokens: int) -> None:
        self.events: list[str] = []
        self.status: int | None = None
        self.replica: str | None = None
        self.error: str | None = None
        body = chat_body("Tell me a story", max_tokens, ignore_eos=True, stream=True)
        body["stream_options"] = {"include_usage": True}
        headers = {**AUTH, SESSION: session}
        self.thread = threading.Thread(target=self._read, args=(cluster.url, body, headers))
        self.thread.start()

    def _read(self, url: str, body: dict, headers: dict) -> None:
        try:
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120
            ) as response:
                self.status, self.replica = response.status_code, response.headers.get(REPLICA)
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    def wait_started(self) -> None:
        wait_until(lambda: self.events or not self.thread.is_alive(), "a stream's first event")

    def finish(self) -> tuple[str | None, int | None]:
        """(finish reason, completion tokens) once the stream has ended with [DONE]."""
        self.thread.join(120)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None and self.status == 200, (self.status, self.error)
        assert self.events[-1] == "[DONE]", self.events[-3:]
        chunks = [json.loads(event) for event in self.events[:-1]]
        assert not any("error" in chunk for chunk in chunks), chunks[-2:]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        usage = [c["usage"] for c in chunks if c.get("usage")]
        return next((r for r in reasons if r), None), usage[-1]["completion_tokens"]


def bench_command(cluster: Cluster, output: Path, num_prompts: int, max_tokens: int) -> list[str]:
    """`tandem bench serve` through the balancer at concurrency 8."""
    return [
        TANDEM,
        "bench",
        "serve",
        "--base-url",
        cluster.url,
        "--api-key",
        KEY,
        "--concurrency",
        "8",
        "--num-prompts",
        str(num_prompts),
        "--max-tokens",
        str(max_tokens),
        "--ignore-eos",
        "--dataset",
        "chat",
        "--endpoint",
        "chat",
        "--warmup",
        "0",
        "--max-duration",
        "150",
        "--output",
        str(output),
    ]


def assert_bench_lost_nothing(output: Path, num_prompts: int, max_tokens: int) -> None:
    (level,) = json.loads(output.read_text())["levels"]
    assert level["concurrency"] == 8
    assert (level["completed"], level["failed"], level["errors"]) == (num_prompts, 0, {}), level
    assert level["usage_reported"] == num_prompts
    assert level["total_output_tokens"] == num_prompts * max_tokens
