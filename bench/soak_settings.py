"""The command line of `tandem bench soak`: its flags, validated into one frozen `Settings`.

Why apart: everything is checked (loopback only, positive bounds, fractions in [0, 1])
before anything touches the network; the rest of the soak reads only `Settings`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.blas_probe import is_loopback
from bench.serve_settings import normalize_base_url


@dataclass(frozen=True)
class Settings:
    """Everything a soak needs, built once from the command line."""

    base_url: str
    model: str | None
    datasets: tuple[str, ...]
    duration_s: float
    concurrency: int
    disconnect_rate: float
    short_tokens: int
    long_tokens: int
    long_fraction: float
    stream_fraction: float
    chat_fraction: float
    max_requests: int
    sample_interval_s: float
    warmup_s: float
    drain_timeout_s: float
    rss_tolerance: float
    rss_slack_mb: float
    seed: int
    api_key: str | None
    output: Path | None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tandem bench soak",
        description="Mixed load with disconnects; checks for leaks and memory growth.",
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model id (default: the first of GET /v1/models)")
    parser.add_argument("--dataset", default="mixed,chat", help="comma-separated datasets")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--disconnect-rate", type=float, default=0.1, help="of streaming")
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=256)
    parser.add_argument("--long-fraction", type=float, default=0.25)
    parser.add_argument("--stream-fraction", type=float, default=0.5)
    parser.add_argument("--chat-fraction", type=float, default=0.5)
    parser.add_argument("--max-requests", type=int, default=100_000)
    parser.add_argument("--sample-interval", type=float, default=1.0, help="seconds")
    parser.add_argument(
        "--warmup", type=float, help="seconds before the reference RSS (default: min(60, 25%%))"
    )
    parser.add_argument("--drain-timeout", type=float, default=120.0, help="seconds")
    parser.add_argument("--rss-tolerance", type=float, default=0.10, help="relative growth")
    parser.add_argument("--rss-slack-mb", type=float, default=50.0, help="absolute growth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key")
    parser.add_argument("--output", type=Path, help="report JSON")
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validate before anything touches the network."""
    base_url = normalize_base_url(args.base_url)
    if not is_loopback(base_url):
        raise SystemExit(f"refusing non-loopback base URL {base_url}: a soak samples local RSS")
    if args.duration <= 0 or args.concurrency < 1 or args.max_requests < 1:
        raise SystemExit("--duration, --concurrency and --max-requests must be positive")
    if min(args.short_tokens, args.long_tokens) < 1 or args.sample_interval <= 0:
        raise SystemExit("--short-tokens, --long-tokens and --sample-interval must be positive")
    fractions = (args.disconnect_rate, args.long_fraction, args.stream_fraction, args.chat_fraction)
    if not all(0.0 <= f <= 1.0 for f in fractions):
        raise SystemExit("rates and fractions must be in [0, 1]")
    warmup = min(60.0, args.duration * 0.25) if args.warmup is None else args.warmup
    return Settings(
        base_url=base_url,
        model=args.model,
        datasets=tuple(name for name in args.dataset.split(",") if name.strip()),
        duration_s=args.duration,
        concurrency=args.concurrency,
        disconnect_rate=args.disconnect_rate,
        short_tokens=args.short_tokens,
        long_tokens=args.long_tokens,
        long_fraction=args.long_fraction,
        stream_fraction=args.stream_fraction,
        chat_fraction=args.chat_fraction,
        max_requests=args.max_requests,
        sample_interval_s=args.sample_interval,
        warmup_s=min(warmup, args.duration),
        drain_timeout_s=args.drain_timeout,
        rss_tolerance=args.rss_tolerance,
        rss_slack_mb=args.rss_slack_mb,
        seed=args.seed,
        api_key=args.api_key,
        output=args.output,
    )
