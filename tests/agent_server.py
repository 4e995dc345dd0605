"""`tandem serve`, with a model forced to play a coding-agent session: the launcher the
real-client tests (tests/test_agent_clients.py) run in a subprocess.

Why a launcher: real `tandem serve` has no forcing, and a tiny random model cannot
decide to call a tool. Everything else is the real thing: the arguments go through
`tandem serve`'s own parser and `build_config`, the app is `server.app.create_app`,
and uvicorn runs it with the same protocol guard and drain as `server.serve`. Only the
scheduler's `logits_processor_factory` is added (tests/agent_clients/scripts.py).

    python -m tests.agent_server WORKDIR [--seconds S] -- MODEL_DIR [tandem serve flags]

It listens on 127.0.0.1 on a free port, prints "PORT <n>" once it accepts
connections, and exits after S seconds (or on SIGTERM, draining like `tandem serve`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import socket
import sys
import time
from pathlib import Path

import uvicorn


def parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    ours = argparse.ArgumentParser(prog="python -m tests.agent_server")
    ours.add_argument("workdir", help="folder the scripted tool calls edit files under")
    ours.add_argument("--seconds", type=float, default=900.0, help="exit after this long")
    ours.add_argument(
        "--hold-first-token",
        type=float,
        default=0.0,
        metavar="S",
        help="hold the first request's first token S seconds: a long prefill, as clients see it",
    )
    split = argv.index("--") if "--" in argv else len(argv)
    launcher = ours.parse_args(argv[:split])
    from server.cli import build_parser

    serve_args = build_parser().parse_args(["serve", *argv[split + 1 :]])
    return launcher, serve_args


async def run(launcher: argparse.Namespace, args: argparse.Namespace) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from server.app import create_app
    from server.connections import guarded_protocol
    from server.logging_setup import uvicorn_log_config
    from server.serve import DrainingServer, build_config, connection_limits
    from tests.agent_clients.scripts import agent_forcing_factory, client_scripts

    config = build_config(args)
    tokenizer = load_tokenizer(Path(config.scheduler.model))
    factory = agent_forcing_factory(tokenizer, client_scripts(launcher.workdir))
    if launcher.hold_first_token > 0:
        factory = holding_first_token(factory, launcher.hold_first_token)
    scheduler = dataclasses.replace(config.scheduler, logits_processor_factory=factory)
    config = dataclasses.replace(config, scheduler=scheduler)
    app = create_app(config)
    limits = connection_limits(args)
    server = DrainingServer(
        uvicorn.Config(
            app,
            http=guarded_protocol(limits),
            ws="none",
            timeout_keep_alive=limits.keep_alive_timeout,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            log_config=uvicorn_log_config(args.log_format),
        ),
        app.state.scheduler,
        config.shutdown_timeout,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        print(f"PORT {sock.getsockname()[1]}", flush=True)
    stop = asyncio.get_running_loop().call_later(launcher.seconds, server.handle_exit, 15, None)
    await serving
    stop.cancel()
    if server.load_error:
        raise SystemExit(f"agent_server: {server.load_error}")


def holding_first_token(factory, seconds: float):
    """`factory`, with the server's first request held `seconds` before its first token
    (on the engine thread, as a prefill of that length would be); later ones are not."""
    held: list[bool] = []  # engine thread only

    def hold(tokens, logits):
        if not held:
            held.append(True)
            time.sleep(seconds)
        return logits

    def holding(request) -> list:
        return [hold, *factory(request)] if not held else factory(request)

    return holding


def main(argv: list[str] | None = None) -> None:
    from engines.platform.blas_preload import ensure_fast_blas
    from engines.platform.precision import keep_float32_exact
    from server.logging_setup import configure_logging

    launcher, args = parse(sys.argv[1:] if argv is None else argv)
    keep_float32_exact()
    configure_logging(args.log_level, args.log_format)
    ensure_fast_blas()
    asyncio.run(run(launcher, args))


if __name__ == "__main__":
    main()
