"""Time to first token of an image prompt, cold and from the prefix cache, beside
mlx-vlm's own server on the same model.

    tandem bench vision [MODEL] [--peer mlx_vlm|none] [--images 4] [--rounds 2]

MODEL is a vision-language model folder; by default a random-weight model of
SmolVLM-256M's shape is built once (`smolvlm_shaped`: SigLIP-base vision tower at
512 pixels, 64 image tokens, a SmolLM2-135M-sized Llama; no hub here). Each server in
turn, alone on 127.0.0.1 with the same fast BLAS: `tandem serve MODEL` (defaults)
and `python -m mlx_vlm.server --model MODEL`. For each of `--images` noise images, a
streamed chat completion (the image as a data URL and a short question, one output
token) measures the time to first token cold, then the same request again (the same
screenshot in an agent's next turn). Then a text stream decodes and a new image's
request comes in the middle: the stream's longest gap while that request is served,
beside its usual gap, says how long a new image holds up someone else's tokens. The
table gives these per server, medians over images, and Tandem's ratio to mlx-vlm;
with `--rounds 2` the second round runs the servers in the other order.

mlx-vlm's server needs mlx-vlm's own dependencies (fastapi, mlx-audio, opencv, ...),
which Tandem does not install; give it a venv of its own and name its python with
`--peer-python` (default: `.vlm-peer-venv/bin/python` beside this repository):

    python -m venv .vlm-peer-venv
    .vlm-peer-venv/bin/pip install 'mlx[cpu]==0.32.4' mlx-vlm==0.7.10
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np

from bench.peer import peer_env
from bench.single_stream import free_port, start_process, start_server, stop_server
from engines.platform.blas import find_fast_blas

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is in this picture?"


def smolvlm_shaped(out: Path) -> Path:
    """A random Idefics3 of SmolVLM-256M's shape (built once into `out`)."""
    if (out / "model.safetensors").exists():
        return out
    from engines.model.demo import build_tiny_model
    from engines.model.demo_vision import build_idefics3

    tokenizer = build_tiny_model(out.parent / "tokenizer")  # the demo's, trained offline

    text = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
    }
    vision = {
        "hidden_size": 768,
        "num_attention_heads": 12,
        "patch_size": 16,
        "num_hidden_layers": 12,
        "intermediate_size": 3072,
        "image_size": 512,
    }
    return build_idefics3(out, tokenizer, text=text, vision=vision)


def noise_png(seed: int, size: tuple[int, int] = (384, 512)) -> bytes:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def image_request(model: str, image: bytes) -> dict:
    url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
    }


def first_token_seconds(port: int, body: dict) -> float:
    """Seconds from sending `body` to the first streamed content (or the end)."""
    started = time.perf_counter()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                # the first token's text, or the end (a first chunk may carry only the
                # role, with empty content, before the prompt is even read)
                if choice.get("delta", {}).get("content") or choice.get("finish_reason"):
                    break
            if line.startswith("data: [DONE]"):
                break
    return time.perf_counter() - started


def decode_gap(port: int, served: str, image: bytes) -> dict:
    """A text stream decodes; after its 20th chunk a new image's request comes (one
    output token). Returns the stream's longest gap between chunks while that request
    was in flight, the stream's median gap before it, and the request's time."""
    text = {
        "model": served,
        "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
        "max_tokens": 300,
        "temperature": 0,
        "stream": True,
    }
    arrivals: list[float] = []
    window: list[float] = []

    def send_image() -> None:
        started = time.perf_counter()
        first_token_seconds(port, image_request(served, image))
        window.extend([started, time.perf_counter()])

    worker = None
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    with httpx.stream("POST", url, json=text, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            arrivals.append(time.perf_counter())
            if len(arrivals) == 20:
                worker = threading.Thread(target=send_image)
                worker.start()
    if worker is not None:
        worker.join()
    if not window:
        return {"max_gap_s": None, "note": "the stream ended before the image came"}
    gaps = [(b - a, b) for a, b in zip(arrivals, arrivals[1:], strict=False)]
    before = [gap for gap, end in gaps if end < window[0]]
    during = [gap for gap, end in gaps if window[0] <= end <= window[1] + 0.05]
    return {
        "gap_before_s": statistics.median(before) if before else None,
        "max_gap_s": max(during, default=None),
        "image_request_s": window[1] - window[0],
    }


@contextmanager
def server(name: str, model: str, peer_python: str) -> Iterator[tuple[int, str]]:
    """The server `name` on a free port: (port, the model name requests carry)."""
    port = free_port()
    if name == "tandem":
        with tempfile.TemporaryDirectory() as disk:
            proc = start_server(model, port, ["--prefix-cache-dir", disk])
            try:
                yield port, "bench"
            finally:
                stop_server(proc)
        return
    command = [peer_python, "-m", "mlx_vlm.server", "--model", model, "--port", str(port)]
    proc = start_process(command, port, env=peer_env())
    try:
        yield port, model
    finally:
        stop_server(proc)


def measure(name: str, model: str, peer_python: str, images: list[bytes]) -> dict:
    with server(name, model, peer_python) as (port, served):
        first_token_seconds(port, image_request(served, noise_png(999)))  # warm-up
        cold, cached = [], []
        for image in images:
            cold.append(first_token_seconds(port, image_request(served, image)))
            cached.append(first_token_seconds(port, image_request(served, image)))
        gap = decode_gap(port, served, noise_png(1000))
    return {
        "server": name,
        "ttft_cold_s": statistics.median(cold),
        "ttft_cached_s": statistics.median(cached),
        "cold": cold,
        "cached": cached,
        **gap,
    }


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tandem bench vision", description=__doc__)
    parser.add_argument("model", nargs="?", help="a vision-language model folder")
    parser.add_argument("--peer", choices=("mlx_vlm", "none"), default="mlx_vlm")
    parser.add_argument("--peer-python", default=str(ROOT / ".vlm-peer-venv" / "bin" / "python"))
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    model = args.model or str(smolvlm_shaped(Path.home() / ".cache/tandem/bench/smolvlm-shaped"))
    images = [noise_png(seed) for seed in range(args.images)]
    names = ["tandem"] + (["mlx_vlm"] if args.peer == "mlx_vlm" else [])
    rows: list[dict] = []
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            row = {**measure(name, model, args.peer_python, images), "round": round_index}
            print(json.dumps(row), flush=True)
            rows.append(row)
    blas = f"{find_fast_blas() or 'MLX bundled'} preloaded in both servers"
    print(f"model {model} | BLAS {blas} | float32 weights | {args.images} images")
    print(
        f"{'server':10} {'round':>5} {'TTFT cold s':>12} {'TTFT cached s':>14} "
        f"{'stream gap s':>13} {'gap, new image s':>17}"
    )
    for row in rows:
        print(
            f"{row['server']:10} {row['round']:>5} {row['ttft_cold_s']:>12.3f} "
            f"{row['ttft_cached_s']:>14.3f} {seconds(row.get('gap_before_s')):>13} "
            f"{seconds(row.get('max_gap_s')):>17}"
        )
    for round_index in range(args.rounds):
        pair = {r["server"]: r for r in rows if r["round"] == round_index}
        if "mlx_vlm" in pair:
            ours, peer = pair["tandem"], pair["mlx_vlm"]
            print(
                f"round {round_index}: tandem/mlx_vlm TTFT cold "
                f"{ours['ttft_cold_s'] / peer['ttft_cold_s']:.2f}x, cached "
                f"{ours['ttft_cached_s'] / peer['ttft_cached_s']:.2f}x (lower is faster)"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
