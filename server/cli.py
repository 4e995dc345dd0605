"""The `tandem` command: `tandem serve MODEL | --demo`.

Parsing builds one frozen `ServerConfig`; nothing below the CLI reads argv or env.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from server.blas_preload import ensure_fast_blas
from server.logging_setup import configure_logging, uvicorn_log_config

log = logging.getLogger("tandem")

DEMO_MODEL_NAME = "tandem-demo"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help="local mlx-lm model directory or hub id")
    parser.add_argument(
        "--demo",
        action="store_true",
        help="serve a tiny random-weight demo model built offline (output is gibberish)",
    )
    parser.add_argument("--draft-model", help="draft model (path or hub id) for speculation")
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=4,
        help="largest draft length k (adapted per step; requests may ask for up to 8)",
    )
    parser.add_argument("--no-pld", action="store_true", help="disable prompt-lookup decoding")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require this key (Bearer or x-api-key); repeat for several keys",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=4096,
        help="largest max_tokens a request may ask for (also the default)",
    )
    parser.add_argument("--max-queue", type=int, default=256, help="bound on waiting requests")
    parser.add_argument(
        "--max-num-seqs", type=int, default=16, help="requests decoding at once (batch size bound)"
    )
    parser.add_argument(
        "--batch-threshold",
        type=int,
        default=2,
        help="active requests at which continuous batching takes over from speculation",
    )
    parser.add_argument(
        "--batch-return-steps",
        type=int,
        default=4,
        help="steps below the threshold before returning to speculation (hysteresis)",
    )
    parser.add_argument(
        "--prefix-cache-entries",
        type=int,
        default=16,
        help="finished requests' KV caches kept for prefix reuse (0 disables)",
    )
    parser.add_argument(
        "--prefix-cache-gb", type=float, default=2.0, help="memory bound of the prefix cache"
    )
    parser.add_argument("--served-model-name", help="model id clients use (default: dir name)")
    parser.add_argument(
        "--no-blas-preload",
        action="store_true",
        help="Linux CPU: do not re-exec with OpenBLAS/MKL preloaded (env TANDEM_NO_BLAS_PRELOAD=1)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="json: one object per line, per-request fields at the top level",
    )
    parser.add_argument("--no-metrics", action="store_true", help="do not serve GET /metrics")
    parser.add_argument(
        "--metrics-api-key",
        action="append",
        default=[],
        help="a key that may read /metrics (for scrapers); API keys work there too",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("serve", help="run the HTTP server"))
    bench = commands.add_parser("bench", help="benchmarks (tandem bench --help)", add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def build_config(args: argparse.Namespace):
    from scheduler.config import SchedulerConfig
    from server.config import ServerConfig

    if args.demo:
        from engines.demo import build_tiny_model, default_demo_dir

        model_path = str(build_tiny_model(default_demo_dir()))
        name = args.served_model_name or DEMO_MODEL_NAME
    elif args.model:
        model_path = args.model
        name = args.served_model_name or Path(args.model.rstrip("/")).name
    else:
        raise SystemExit("tandem serve: give a MODEL (path or hub id) or --demo")
    keys = tuple(k for k in args.api_key if k)
    return ServerConfig(
        scheduler=SchedulerConfig(
            model=model_path,
            draft_model=args.draft_model,
            num_draft_tokens=args.num_draft_tokens,
            enable_pld=not args.no_pld,
            max_queue=args.max_queue,
            max_num_seqs=args.max_num_seqs,
            batch_threshold=args.batch_threshold,
            batch_return_steps=args.batch_return_steps,
            prefix_cache_entries=args.prefix_cache_entries,
            prefix_cache_bytes=int(args.prefix_cache_gb * (1 << 30)),
        ),
        served_model_name=name,
        host=args.host,
        port=args.port,
        api_keys=keys,
        max_tokens=args.max_tokens,
        demo=args.demo,
        metrics=not args.no_metrics,
        metrics_api_keys=tuple(k for k in args.metrics_api_key if k),
    )


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from engines.blas import describe_blas
    from server.app import create_app

    config = build_config(args)
    log.info("compute: %s, BLAS: %s", _device_name(), describe_blas())
    if config.demo:
        log.warning(
            "demo model: tiny random weights at %s; its output is gibberish", config.scheduler.model
        )
    if not config.api_keys:
        log.info("no --api-key given: requests are not authenticated")
    log.info(
        "serving %s as '%s' on http://%s:%d",
        config.scheduler.model,
        config.served_model_name,
        config.host,
        config.port,
    )
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        log_config=uvicorn_log_config(args.log_format),
    )


def _device_name() -> str:
    import mlx.core as mx

    return str(mx.default_device())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # bench parses its own arguments, --help included
        from bench.cli import main as bench_main

        bench_main(argv[1:])
        return
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    if args.command == "serve":
        if not (args.no_blas_preload or os.environ.get("TANDEM_NO_BLAS_PRELOAD")):
            ensure_fast_blas()
        serve(args)


if __name__ == "__main__":
    main()
