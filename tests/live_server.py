"""A Tandem app on a real socket (127.0.0.1, a free port), served by uvicorn in a thread
of the test process: for client libraries that bring their own HTTP stack (langchain,
pydantic-ai, the SDKs' default clients) and cannot be handed an ASGI transport."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.types import ASGIApp

from scheduler import Scheduler
from server.app import create_app
from server.config import ServerConfig
from tests.conftest import MODEL_NAME


@contextmanager
def live_server(scheduler: Scheduler, **config_overrides) -> Iterator[str]:
    """The base URL (`http://127.0.0.1:PORT`) of the app serving `scheduler` (already
    running, so the app neither starts nor stops it), until the block ends."""
    config = ServerConfig(
        scheduler=scheduler.config, served_model_name=MODEL_NAME, **config_overrides
    )
    with serving(create_app(config, scheduler)) as url:
        yield url


@contextmanager
def serving(app: ASGIApp) -> Iterator[str]:
    """Any ASGI app under uvicorn in a thread on a free loopback port, until the block
    ends: its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, ws="none", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
