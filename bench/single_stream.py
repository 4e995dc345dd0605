"""Single-stream decode speed: a real `tandem serve` process vs plain mlx-lm, one run.

    python -m bench.single_stream [--model random-100m] [--max-tokens 256] [--repeats 3]

The server is a separate process (as users run it) streamed over HTTP on 127.0.0.1;
mlx-lm runs `stream_generate` in this process while the server is idle. Decode rate
is tokens after the first over the time after the first, median of the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.models import resolve_model

PROMPT = "Once upon a time there was a little robot who loved to read books about the sea."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str, port: int, extra: list[str] | tuple = ()) -> subprocess.Popen:
    """`tandem serve MODEL` on 127.0.0.1:port, healthy, with `extra` flags."""
    tandem = str(Path(sys.executable).parent / "tandem")
    cmd = [
        tandem,
        "serve",
        model,
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--log-level",
        "warning",
        *extra,
    ]
    return start_process(cmd, port)


def start_process(
    cmd: list[str],
    port: int,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    own_group: bool = False,
) -> subprocess.Popen:
    """Start the server `cmd` (listening on 127.0.0.1:port) and wait until its
    `GET /health` answers 200. Its output goes to `log` (quoted when it fails to
    start), or nowhere. `own_group`: in a process group of its own, which
    `stop_server` signals whole, with a stdin that stays open and empty: for
    `mlx.launch`, which forwards its stdin to the ranks and spins on one at its end."""
    out = log.open("w") if log else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if own_group else None,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=own_group,
        )
    finally:
        if log:
            out.close()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited during startup: {cmd[0]}{log_tail(log)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    stop_server(proc)
    raise SystemExit(f"server did not become healthy: {cmd[0]}{log_tail(log)}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (its whole group when it leads one), then SIGKILL after 60 s."""
    group = os.getpgid(proc.pid) == proc.pid if proc.poll() is None else False
    signal_it = (lambda sig: os.killpg(proc.pid, sig)) if group else proc.send_signal
    signal_it(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        signal_it(signal.SIGKILL)
        proc.wait()
    if group:  # the ranks may outlive the launcher by a moment
        time.sleep(1)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def log_tail(log: Path | None, lines: int = 20) -> str:
    if log is None or not log.exists():
        return ""
    tail = log.read_text(errors="replace").splitlines()[-lines:]
    return f"\n--- last lines of {log} ---\n" + "\n".join(tail)


def server_decode_rate(port: int, max_tokens: int) -> float:
    """(completion tokens - 1) / (last chunk time - first chunk time), tokens from usage."""
    payload = {
        "model": "bench",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stamps, tokens = [], 0
    url = f"http://127.0.0.1:{port}/v1/completions"
    with httpx.stream("POST", url, json=payload, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            else:
                stamps.append(time.perf_counter())
    return (tokens - 1) / (stamps[-1] - stamps[0])


def mlx_lm_decode_rate(model, tokenizer, max_tokens: int) -> float:
    from mlx_lm import stream_generate

    responses = list(stream_generate(model, tokenizer, PROMPT, max_tokens=max_tokens))
    return responses[-1].generation_tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random-100m")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from engines.platform.blas import describe_blas

    model_path = resolve_model(args.model)
    model, tokenizer = load(model_path)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    port = free_port()
    server = start_server(model_path, port)
    try:
        server_decode_rate(port, 16)  # warm-up
        mlx_lm_decode_rate(model, tokenizer, 16)
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(server_decode_rate(port, args.max_tokens))
            theirs.append(mlx_lm_decode_rate(model, tokenizer, args.max_tokens))
    finally:
        stop_server(server)
    served, plain = statistics.median(ours), statistics.median(theirs)
    print(f"model      {args.model} ({model_path}), {n_params / 1e6:.1f}M params")
    print(
        f"device     {mx.default_device()}, BLAS {describe_blas()} "
        f"(LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r})"
    )
    print(f"settings   greedy, {args.max_tokens} tokens, median of {args.repeats}")
    print(f"mlx-lm stream_generate   {plain:8.1f} tok/s   runs {[round(r, 1) for r in theirs]}")
    print(f"tandem serve (HTTP SSE)  {served:8.1f} tok/s   runs {[round(r, 1) for r in ours]}")
    print(f"ratio tandem / mlx-lm    {served / plain:8.3f}")


if __name__ == "__main__":
    main()
