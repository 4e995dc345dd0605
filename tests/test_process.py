"""Against a real `tandem serve` process (uvicorn) on 127.0.0.1: startup, BLAS
selection, streaming, and a mid-stream disconnect that cancels generation."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from bench.single_stream import free_port
from engines.platform.blas import computes_on_cpu, find_fast_blas
from engines.platform.precision import TF32_VARIABLE, float32_matmuls, keep_float32_exact

TANDEM = str(Path(sys.executable).parent / "tandem")
# Without these the server decides for itself whether to re-exec with a fast BLAS,
# as it does when a user starts it.
BLAS_PRELOAD = ("LD_PRELOAD", "TANDEM_BLAS_REEXEC")


def env_without(*names: str, **extra: str) -> dict[str, str]:
    """This process's environment less `names`, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if k not in names}, **extra}


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.port = free_port()
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-{self.port}.log"
        self.log_file = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [TANDEM, "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{self.log()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not healthy in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self.log_file.flush()
        return self.log_path.read_text()

    def wait_for_log(self, pattern: str, timeout: float = 10) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log())
            if match:
                return match
            time.sleep(0.1)
        raise AssertionError(f"log never matched {pattern!r}:\n{self.log()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log_file.close()


@contextmanager
def running_server(args: list[str], env: dict[str, str]) -> Iterator[ServerProcess]:
    """A healthy `tandem serve ARGS`, stopped when the block ends."""
    server = ServerProcess(args, env)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    args = [str(tiny_model_dir), "--served-model-name", "tiny"]
    # MLX_ENABLE_TF32 as a user leaves it: unset (the tests' own process sets it).
    with running_server(args, env_without(*BLAS_PRELOAD, TF32_VARIABLE)) as proc:
        yield proc


def test_startup_log_names_the_blas_in_use(server):
    line = server.wait_for_log(r"BLAS: (\w+)")
    if sys.platform.startswith("linux") and not computes_on_cpu():
        assert line.group(1) == "gpu", server.log()
    elif sys.platform.startswith("linux") and find_fast_blas() is not None:
        assert line.group(1) in ("openblas", "mkl"), server.log()
    assert "serving" in server.log()


def test_float32_products_run_in_full_precision_unless_the_user_chose(server):
    """TF32 (NVIDIA, Apple M5) would round a verify step's products but not a plain
    step's, so greedy speculation would drift from plain decoding: off by default."""
    assert "float32 matmuls: full" in server.wait_for_log(r"compute: .*").group(0)
    chosen = {TF32_VARIABLE: "1"}
    keep_float32_exact(chosen)
    assert chosen == {TF32_VARIABLE: "1"} and float32_matmuls(chosen) != "full"
    unset: dict[str, str] = {}
    keep_float32_exact(unset)
    assert float32_matmuls(unset) == "full"


def test_streaming_over_real_socket(server):
    payload = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 20,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=payload, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) >= 3


def test_disconnect_mid_stream_cancels_generation(server):
    max_tokens = 1900
    payload = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=payload, timeout=30) as r:
        received = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                received += 1
            if received == 5:
                break  # leaving the block closes the connection mid-stream
    match = server.wait_for_log(r"request (cmpl-\w+) cancelled: .*completion_tokens=(\d+)")
    assert int(match.group(2)) < max_tokens
    # The engine is free again: a new request is served at once.
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 5},
        timeout=30,
    )
    assert response.status_code == 200


def test_demo_random_flag_serves_and_warns(tmp_path):
    with running_server(["--demo-random"], env_without(XDG_CACHE_HOME=str(tmp_path))) as proc:
        assert "gibberish" in proc.log()
        response = httpx.post(
            f"{proc.url}/v1/chat/completions",
            json={
                "model": "tandem-demo",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8,
            },
            timeout=30,
        )
        assert response.status_code == 200
        assert (tmp_path / "tandem" / "demo-model" / "model.safetensors").exists()


def test_speculation_flags_reach_the_engine(tiny_model_dir, tiny_draft_dir):
    draft = [str(tiny_model_dir), "--draft-model", str(tiny_draft_dir), "--num-draft-tokens", "3"]
    with running_server(draft, dict(os.environ)) as proc:
        proc.wait_for_log(r"speculation: methods=pld\+draft k=3")
    with running_server([str(tiny_model_dir), "--no-pld"], dict(os.environ)) as proc:
        proc.wait_for_log(r"speculation: methods=none k=8")


@pytest.mark.parametrize("model", ["missing directory", "gguf file"])
def test_a_model_that_cannot_load_exits_nonzero_with_the_reason(tmp_path, model):
    """A supervisor (systemd, launchd) restarts and a person sees why, instead of a
    process that stays up answering 503 forever."""
    if model == "gguf file":
        path = tmp_path / "model.gguf"
        path.write_bytes(b"GGUF" + bytes(60))
    else:
        path = tmp_path / "nonexistent"
    started = time.monotonic()
    result = subprocess.run(
        [TANDEM, "serve", str(path), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_without(*BLAS_PRELOAD),
    )
    assert result.returncode != 0
    assert time.monotonic() - started < 30
    last_line = result.stderr.strip().splitlines()[-1]
    assert "model load failed" in last_line and str(path) in last_line, result.stderr


def test_distributed_without_a_launcher_exits_with_how_to_launch(tiny_model_dir):
    """`--distributed` in a process that mlx.launch did not start is alone (rank 0 of
    1): it says how to launch instead of serving an unsharded model under that flag."""
    result = subprocess.run(
        [
            TANDEM,
            "serve",
            str(tiny_model_dir),
            "--distributed",
            "tensor",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_without(*BLAS_PRELOAD, "MLX_RANK", "MLX_HOSTFILE"),
    )
    assert result.returncode == 1
    assert "mlx.launch" in result.stderr.strip().splitlines()[-1], result.stderr
