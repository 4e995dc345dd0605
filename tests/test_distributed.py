"""`tandem serve --distributed`: one model sharded over two local ranks on 127.0.0.1
with MLX's ring backend. Greedy output equals a single-process server's, with and
without drafting (the draft model and prompt lookup run on rank 0, verify is a
sharded forward); a prefix-cache hit (a copied cache) stays exact; a rank that dies
fails the in-flight stream with an error event and turns /health to 503."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from bench.single_stream import free_port
from tests.test_process import TANDEM, ServerProcess, env_without
from tests.tiny_archs import build_tiny_arch

pytestmark = pytest.mark.slow

MLX_LAUNCH = str(Path(sys.executable).parent / "mlx.launch")
PROMPTS = [
    "the cat sat on the mat. the cat sat on the mat. the cat sat on the",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "Once upon a time there was a",
]
# Served at once: rows join and leave the batch at different times. Long enough that
# they overlap however fast this machine decodes (they arrive within 0.15 s).
CONCURRENT = [(PROMPTS[0], 200), (PROMPTS[1], 120), (PROMPTS[2], 240), (PROMPTS[0] + " mat", 160)]


class RankedServer(ServerProcess):
    """Rank 0 of a distributed `tandem serve`, started by `command` (which starts the
    other ranks too: mlx.launch, or one process per rank)."""

    def __init__(self, procs: list[subprocess.Popen], port: int, log_path: Path) -> None:
        self.procs, self.proc, self.port = procs, procs[0], port
        self.log_path, self.log_file = log_path, log_path.open("a")
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.log_file.close()


def serve_args(model: Path, port: int, *extra: str, mode: str = "tensor") -> list[str]:
    return [TANDEM, "serve", str(model), "--distributed", mode, "--port", str(port), *extra]


def free_consecutive_ports(count: int) -> int:
    """The first of `count` free ports in a row: mlx.launch gives rank r the port
    --starting-port + r, and a taken one fails the launch ("Couldn't bind socket")."""
    while True:
        first = free_port()
        try:
            for port in range(first + 1, first + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue


@contextmanager
def launched(model: Path, *extra: str, mode: str = "tensor") -> Iterator[RankedServer]:
    """Two ranks through `mlx.launch --backend ring` on 127.0.0.1."""
    port, ring_port = free_port(), free_consecutive_ports(2)
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-dist-{port}.log"
    launcher = [MLX_LAUNCH, "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1"]
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                *launcher,
                "--starting-port",
                str(ring_port),
                "--",
                *serve_args(model, port, *extra, mode=mode),
            ],
            stdin=subprocess.PIPE,  # open and empty: at EOF the launcher spins on it
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env_without("LD_PRELOAD", "TANDEM_BLAS_REEXEC"),
            start_new_session=True,
        )
    server = RankedServer([proc], port, log_path)
    try:
        server.wait_healthy(timeout=120)
        yield server
    finally:
        server.stop()


@contextmanager
def ranks_by_hand(model: Path, tmp_path: Path, *extra: str) -> Iterator[RankedServer]:
    """Two ranks started one by one with the environment `mlx.launch --backend ring`
    gives them (MLX_RANK, MLX_HOSTFILE), so the test, not the launcher, decides what
    happens when one dies."""
    port = free_port()
    hostfile = tmp_path / "ring-hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    log_path = tmp_path / "ranks.log"
    procs = []
    with log_path.open("w") as log:
        for rank in range(2):
            env = env_without(
                "LD_PRELOAD", "TANDEM_BLAS_REEXEC", MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile)
            )
            procs.append(
                subprocess.Popen(
                    serve_args(model, port, *extra),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )
    server = RankedServer(procs, port, log_path)
    try:
        server.wait_healthy(timeout=120)
        yield server
    finally:
        server.stop()


def complete(url: str, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_sharded_greedy_output_equals_one_process_with_and_without_drafting(tiny_model_dir):
    single = ServerProcess([str(tiny_model_dir), "--no-pld"], env_without("LD_PRELOAD"))
    try:
        single.wait_healthy()
        expected = [complete(single.url, p)["choices"][0]["text"] for p in PROMPTS]
        expected_together = [
            complete(single.url, p, max_tokens=n)["choices"][0]["text"] for p, n in CONCURRENT
        ]
    finally:
        single.stop()

    # The target itself as the draft model (whole, on rank 0): its drafts are
    # accepted, so verify forwards and rollbacks of the sharded cache both run.
    with launched(tiny_model_dir, "--draft-model", str(tiny_model_dir)) as server:
        drafted = 0
        for prompt, text in zip(PROMPTS, expected, strict=True):
            plain = complete(server.url, prompt, enable_pld=False, enable_draft=False)
            assert plain["choices"][0]["text"] == text
            assert plain["speculation"]["draft_tokens"] == 0
            for overrides in ({"enable_pld": False}, {"enable_draft": False}, {}):
                spec = complete(server.url, prompt, **overrides)
                assert spec["choices"][0]["text"] == text, (prompt, overrides)
                drafted += spec["speculation"]["accepted_tokens"]
        assert drafted > 0, "no draft was accepted: the verify path did not run"

        # The same prompt again starts from a copy of the first request's cache.
        again = complete(server.url, PROMPTS[0], enable_pld=False)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert again["choices"][0]["text"] == expected[0]
        assert "rank 1 of 2" in server.log()
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'tandem_ranks{model_name="tiny"} 2.0' in metrics

        # Concurrent requests: the batched engine (drafting per row, ragged caches that
        # the follower mirrors), joins, leaves, and migration both ways.
        def one(index: int) -> str:
            time.sleep(0.05 * index)
            prompt, max_tokens = CONCURRENT[index]
            return complete(server.url, prompt, max_tokens=max_tokens)["choices"][0]["text"]

        with ThreadPoolExecutor(len(CONCURRENT)) as pool:
            together = list(pool.map(one, range(len(CONCURRENT))))
        assert together == expected_together
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert switches(metrics, "speculative", "batched") >= 1
        assert switches(metrics, "batched", "speculative") >= 1
        spec_steps = [
            line for line in metrics.splitlines() if "tandem_spec_batch_size_count" in line
        ]
        assert spec_steps and float(spec_steps[0].rsplit(" ", 1)[1]) > 0, "no batched drafts"


def switches(metrics: str, source: str, target: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("tandem_mode_switches_total{") and f'from="{source}"' in line:
            if f'to="{target}"' in line:
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {source} -> {target} series in /metrics")


def test_copies_of_a_decoding_requests_cache_serve_requests_arriving_meanwhile(tiny_model_dir):
    """Requests of the key arriving while the first decodes the same prompt start from a
    copy of its cache (`Engine.copy_cache`), one after the other while the first goes
    on: each copy has a name of its own on every rank, so the copy kept in the prefix
    cache still serves after the first moved into the batch and its own name was freed.
    Every answer is the first's greedy prefix; the server stays up."""
    prompt = PROMPTS[0] * 8
    with launched(tiny_model_dir, "--prefill-follow-min-tokens", "16", "--no-pld") as server:
        body = {"prompt": prompt, "max_tokens": 800, "temperature": 0, "ignore_eos": True}
        started = threading.Event()

        def leader() -> str:
            text = ""
            with httpx.stream(
                "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
                        started.set()
            return text

        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(leader)
            assert started.wait(60)
            meanwhile = [complete(server.url, prompt, max_tokens=16) for _ in range(3)]
            assert not first.done(), "the first finished before the others: make it longer"
            text = first.result()
        for reply in meanwhile:
            assert text.startswith(reply["choices"][0]["text"])
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'tandem_prefill_follows_total{model_name="tiny",outcome="copied"} 1.0' in metrics
        assert server.proc.poll() is None


def test_pipeline_stages_give_one_process_output(tiny_model_dir, tmp_path):
    """Ministral 3 split into two pipeline stages (each rank holds half the layers and
    passes activations on), prompt lookup and the model as its own draft on rank 0."""
    model = build_tiny_arch("ministral3", tmp_path / "ministral3", tiny_model_dir)
    single = ServerProcess([str(model), "--no-pld"], env_without("LD_PRELOAD"))
    try:
        single.wait_healthy()
        expected = [complete(single.url, p)["choices"][0]["text"] for p in PROMPTS]
    finally:
        single.stop()
    with launched(model, "--draft-model", str(model), mode="pipeline") as server:
        accepted = 0
        for prompt, text in zip(PROMPTS, expected, strict=True):
            reply = complete(server.url, prompt)
            assert reply["choices"][0]["text"] == text, prompt
            accepted += reply["speculation"]["accepted_tokens"]
        assert accepted > 0
        assert "pipeline parallel" in server.log()


def test_a_rank_that_dies_fails_the_stream_and_health(tiny_model_dir, tmp_path):
    with ranks_by_hand(tiny_model_dir, tmp_path) as server:
        body = {"prompt": PROMPTS[2], "max_tokens": 1900, "ignore_eos": True, "stream": True}
        events: list[dict] = []
        started = time.monotonic()
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[len("data: ") :]))
                if len(events) == 5:
                    os.killpg(server.procs[1].pid, signal.SIGKILL)
        assert time.monotonic() - started < 60
        assert "error" in events[-1], events[-3:]
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 503
        assert health.json()["status"] == "failed"
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert refused.status_code == 503


def test_a_rank_that_dies_while_idle_turns_health_to_503(tiny_model_dir, tmp_path):
    """Every other rank holds a connection to rank 0 (engines/distributed/rank_watch.py) that its
    process's end closes: an idle rank 0 fails at once, so a balancer stops sending
    work before a request finds the rank gone."""
    with ranks_by_hand(tiny_model_dir, tmp_path) as server:
        assert complete(server.url, PROMPTS[2])["choices"][0]["text"]
        os.killpg(server.procs[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "rank 0 never noticed"
            time.sleep(0.2)
        assert httpx.get(f"{server.url}/health", timeout=5).json()["status"] == "failed"
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert refused.status_code == 503
