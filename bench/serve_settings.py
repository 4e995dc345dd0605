"""The command line of `tandem bench serve`: its flags, validated into one frozen `Settings`.

Why apart: parsing and validation happen before anything touches the network, and the
rest of the benchmark reads only `Settings`.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.blas_probe import is_loopback
from bench.peer import add_peer_arguments
from bench.serve_dataset import BUILTIN_DATASETS

ENDPOINTS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
}


@dataclass(frozen=True)
class Settings:
    """Everything a run needs, built once from the command line."""

    base_url: str
    model: str | None
    dataset: str
    endpoint: str
    concurrency: tuple[int, ...]
    num_prompts: int
    max_tokens: int
    temperature: float
    seed: int
    request_rate: float
    ignore_eos: bool
    api_key: str | None
    check_greedy: bool
    allow_remote: bool
    max_duration_s: float
    max_requests: int
    warmup: int
    output: Path | None
    plot: Path | None
    peer: str = "none"
    peer_model: str | None = None
    peer_draft_model: str | None = None
    peer_num_draft_tokens: int | None = None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tandem bench serve",
        description="Load test an OpenAI-compatible server at several concurrency levels.",
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model id (default: the first of GET /v1/models)")
    parser.add_argument("--concurrency", default="1,2,4,8", help="comma-separated levels")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--dataset", default="mixed", help=f"{'|'.join(BUILTIN_DATASETS)} or a .jsonl file"
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: closed loop)",
    )
    parser.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="arrivals; sampled requests")
    parser.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM)")
    parser.add_argument("--api-key")
    parser.add_argument("--output", type=Path, help="results JSON")
    parser.add_argument("--plot", type=Path, help="results PNG (needs matplotlib)")
    parser.add_argument(
        "--check-greedy",
        action="store_true",
        help="temperature 0; every response must equal the prompt's solo response",
    )
    parser.add_argument("--allow-remote", action="store_true", help="allow non-loopback hosts")
    parser.add_argument("--max-duration", type=float, default=600.0, help="seconds in all")
    parser.add_argument("--max-requests", type=int, default=2000, help="requests in all")
    parser.add_argument(
        "--warmup", type=int, default=1, help="unmeasured requests first (cold-start costs)"
    )
    add_peer_arguments(parser, default="none")
    parser.add_argument(
        "--peer-model", help="the peer's model path (needed with --peer: /v1/models names no paths)"
    )
    parser.add_argument(
        "--peer-draft-model", help="also run the peer with this draft (--draft-model)"
    )
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validate before anything touches the network."""
    base_url = normalize_base_url(args.base_url)
    if not args.allow_remote and not is_loopback(base_url):
        raise SystemExit(
            f"refusing non-loopback base URL {base_url} (pass --allow-remote to load test "
            "a server on another host)"
        )
    levels = parse_levels(args.concurrency)
    if args.num_prompts < 1 or args.max_tokens < 1 or args.max_requests < 1:
        raise SystemExit("--num-prompts, --max-tokens and --max-requests must be >= 1")
    if args.request_rate <= 0:
        raise SystemExit("--request-rate must be > 0")
    if args.peer == "none" and (args.peer_model or args.peer_draft_model):
        raise SystemExit("--peer-model and --peer-draft-model need --peer mlx_lm")
    if args.peer != "none" and not args.peer_model:
        raise SystemExit("--peer mlx_lm needs --peer-model PATH (the model the server serves)")
    return Settings(
        base_url=base_url,
        model=args.model,
        dataset=args.dataset,
        endpoint=args.endpoint,
        concurrency=levels,
        num_prompts=args.num_prompts,
        max_tokens=args.max_tokens,
        temperature=0.0 if args.check_greedy else args.temperature,
        seed=args.seed,
        request_rate=args.request_rate,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        check_greedy=args.check_greedy,
        allow_remote=args.allow_remote,
        max_duration_s=args.max_duration,
        max_requests=args.max_requests,
        warmup=max(0, args.warmup),
        output=args.output,
        plot=args.plot,
        peer=args.peer,
        peer_model=args.peer_model,
        peer_draft_model=args.peer_draft_model,
        peer_num_draft_tokens=args.peer_num_draft_tokens,
    )


def normalize_base_url(url: str) -> str:
    """Accept `http://host:port`, with or without a trailing `/` or `/v1`."""
    url = url.rstrip("/")
    url = url.removesuffix("/v1")
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise SystemExit(f"--base-url must be http(s)://host[:port], got {url!r}")
    return url


def parse_levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise SystemExit(f"--concurrency must be integers like 1,2,4,8, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise SystemExit("--concurrency levels must be >= 1")
    return levels
