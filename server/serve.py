"""`tandem serve`: build the config from parsed flags, check it is safe to run,
and run uvicorn with a graceful drain on SIGTERM/SIGINT.

Drain: the first signal stops new requests (503, /health turns 503 so balancers move
away), lets in-flight ones finish for up to --shutdown-timeout, aborts the rest so
their streams end with an error event, then stops uvicorn and exits 0. A second
signal exits at once.

A model that cannot load stops the server too: it exits 1 with the reason on
stderr, so a supervisor restarts it and a person sees why.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import time
from pathlib import Path

import uvicorn

from engines.gating.measured_costs import CostModel
from engines.model.registry import local_config
from engines.model.vision import is_vision_config
from scheduler import SchedulerState
from scheduler.config import SchedulerConfig
from scheduler.prefix_folder import keys_from_file
from server.auth import check_keys
from server.config import ServerConfig
from server.connections import ConnectionLimits, fitting_open_file_limit, guarded_protocol
from server.hosts import ANY_HOST
from server.images import ImageLimits
from server.log_throttle import RefusedRequestLogThrottle
from server.logging_setup import uvicorn_log_config

log = logging.getLogger("tandem")

DEMO_MODEL_NAME = "tandem-demo"


def load_api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """Keys from --api-key (repeatable), --api-key-file (one per line) and TANDEM_API_KEY."""
    keys = [k.strip() for k in args.api_key] + keys_from_file(args.api_key_file)
    keys += [k.strip() for k in os.environ.get("TANDEM_API_KEY", "").split(",")]
    return tuple(dict.fromkeys(k for k in keys if k))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(args: argparse.Namespace, keyed: bool) -> tuple[str, ...]:
    """Host names a keyless server answers besides loopback names and IP addresses;
    a keyed server answers any unless --allowed-hosts narrows it."""
    given = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    return given or ((ANY_HOST,) if keyed else ())


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        max_connections=fitting_open_file_limit(args.max_connections),
    )


def body_limit(args: argparse.Namespace, model_path: str) -> int:
    """--max-body-bytes, or its default: 4 MiB, or 32 MiB for a model folder with a
    vision tower (a screenshot sent as base64 alone is often over 4 MiB)."""
    if args.max_body_bytes is not None:
        return args.max_body_bytes
    return 32 << 20 if is_vision_config(local_config(model_path)) else 4 << 20


def build_config(args: argparse.Namespace) -> ServerConfig:
    if args.demo and args.demo_random:
        raise SystemExit("tandem serve: --demo or --demo-random, not both")
    if args.demo:
        from engines.model.packaged_models import SMOLLM2_135M

        model_path = SMOLLM2_135M.name  # fetched and imported when the model loads
        name = args.served_model_name or DEMO_MODEL_NAME
    elif args.demo_random:
        from engines.model.demo import build_tiny_model, default_demo_dir

        model_path = str(build_tiny_model(default_demo_dir()))
        name = args.served_model_name or DEMO_MODEL_NAME
    elif args.model:
        model_path = args.model
        path = Path(args.model.rstrip("/"))
        name = args.served_model_name or (path.stem if path.suffix == ".gguf" else path.name)
    else:
        raise SystemExit("tandem serve: give a MODEL (folder, .gguf file or hub id) or --demo")
    for flag, value in (
        ("--max-tokens", args.max_tokens),
        ("--default-max-tokens", args.default_max_tokens),
    ):
        if value is not None and value < 1:
            raise SystemExit(f"tandem serve: {flag} must be at least 1 (it is {value})")
    keys = load_api_keys(args)
    metrics_keys = tuple(
        k for k in [*args.metrics_api_key, *keys_from_file(args.metrics_api_key_file)] if k
    )
    check_keys(keys)
    check_keys(metrics_keys, "metrics key")
    if not keys and not is_loopback(args.host) and not args.allow_unauthenticated:
        raise SystemExit(
            f"tandem serve: refusing to listen on {args.host} without an API key; anyone on "
            "the network could use it. Give --api-key/--api-key-file/TANDEM_API_KEY, or "
            "--allow-unauthenticated if that is really what you want."
        )
    return ServerConfig(
        scheduler=SchedulerConfig(
            model=model_path,
            draft_model=args.draft_model,
            draft_kind=args.draft_kind,
            num_draft_tokens=args.num_draft_tokens,
            draft_vocab=args.draft_vocab,
            enable_pld=not args.no_pld,
            suffix_tokens_per_key=max(0, args.suffix_tokens_per_key),
            suffix_max_keys=max(0, args.suffix_max_keys),
            mtp=not args.no_mtp,
            mtp_weights=args.mtp_weights,
            max_queue=args.max_queue,
            max_num_seqs=args.max_num_seqs,
            max_per_key=args.max_per_key,
            max_unread_events=args.max_unread_events,
            unread_timeout=args.unread_timeout,
            batch_threshold=args.batch_threshold,
            batch_return_steps=args.batch_return_steps,
            spec_wait_budget=args.spec_wait_budget,
            prefix_cache_entries=args.prefix_cache_entries,
            prefix_cache_bytes=int(args.prefix_cache_gb * (1 << 30)),
            prefix_cache_dir=args.prefix_cache_dir,
            prefix_cache_disk_bytes=int(args.prefix_cache_disk_gb * (1 << 30)),
            prefill_follow_min_tokens=max(0, args.prefill_follow_min_tokens),
            max_tower_pixels=max(1, args.max_tower_pixels),
            max_kv_bytes=None if args.max_kv_gb is None else int(args.max_kv_gb * (1 << 30)),
            request_timeout=args.request_timeout,
            fault_marker=args.inject_fault_on,
            gguf_dtype=args.dtype,
            distributed=args.distributed,
            cost_model=CostModel.assumed(9) if args.assume_draft_costs else None,
        ),
        served_model_name=name,
        responses_store_bytes=int(args.responses_store_mb * (1 << 20)),
        host=args.host,
        port=args.port,
        api_keys=keys,
        max_tokens=args.max_tokens,
        default_max_tokens=args.default_max_tokens,
        strict_max_tokens=args.strict_max_tokens,
        stream_keepalive=args.stream_keepalive,
        demo=args.demo_random,
        metrics=not args.no_metrics,
        ui=not args.no_ui,
        metrics_api_keys=metrics_keys,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        max_body_bytes=body_limit(args, model_path),
        body_timeout=args.body_timeout,
        allowed_hosts=allowed_hosts(args, keyed=bool(keys)),
        rate_limit_per_minute=args.rate_limit,
        shutdown_timeout=args.shutdown_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        strict_tool_calls=args.strict_tool_calls,
        tool_call_grammar=args.tool_call_grammar,
        image_limits=ImageLimits.from_args(args),
    )


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before the usual shutdown."""

    def __init__(self, config: uvicorn.Config, scheduler, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.scheduler = scheduler
        self.shutdown_timeout = shutdown_timeout
        self._drain_task: asyncio.Task | None = None
        self.load_error: str | None = None

    async def on_tick(self, counter: int) -> bool:
        scheduler = self.scheduler
        if self.load_error is None and scheduler.state == SchedulerState.FAILED:
            if scheduler.model_info is None:  # the model never loaded: nothing to serve
                self.load_error = scheduler.error or "model load failed"
                self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_task is not None or self.should_exit:
            log.warning("second signal: exiting now")
            self.force_exit = True
            self.should_exit = True
            return
        log.info("%s: draining (up to %.0fs)", signal.Signals(sig).name, self.shutdown_timeout)
        self._drain_task = asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        self.scheduler.begin_drain()
        deadline = time.monotonic() + self.shutdown_timeout
        while self.scheduler.num_outstanding and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.scheduler.num_outstanding
        if left:
            log.warning("drain timeout: aborting %d request(s)", left)
            self.scheduler.abort_all("server is shutting down")
            flush_deadline = time.monotonic() + 5
            while self.scheduler.num_outstanding and time.monotonic() < flush_deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # let the streams write their error events
        self.should_exit = True


def serve(args: argparse.Namespace) -> None:
    import mlx.core as mx

    from engines.platform.blas import describe_blas
    from engines.platform.precision import float32_matmuls
    from server.app import create_app

    config = build_config(args)
    device, blas, matmuls = mx.default_device(), describe_blas(), float32_matmuls()
    log.info("compute: %s, BLAS: %s, float32 matmuls: %s", device, blas, matmuls)
    if config.scheduler.distributed:
        from scheduler.follower import follower_rank, run_follower

        rank = follower_rank()
        if rank:  # rank 0 serves; the others only run their shard of its forwards
            run_follower(config.scheduler, rank, config.shutdown_timeout)
            return
        log.info("distributed (%s parallel): rank 0 serves HTTP", config.scheduler.distributed)
    if config.demo:
        log.warning(
            "demo model: tiny random weights at %s; its output is gibberish", config.scheduler.model
        )
    if not config.api_keys:
        log.info("no API key configured: requests are not authenticated")
    log.info(
        "serving %s as '%s' on http://%s:%d",
        config.scheduler.model,
        config.served_model_name,
        config.host,
        config.port,
    )
    app = create_app(config)
    limits = connection_limits(args)
    log.info(
        "connections: at most %d; request head within %gs, body within %gs, idle %ds",
        limits.max_connections,
        limits.header_timeout,
        limits.body_timeout,
        limits.keep_alive_timeout,
    )
    uvicorn_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=guarded_protocol(limits),
        ws="none",  # no WebSocket routes: upgrades are not accepted at all
        timeout_keep_alive=limits.keep_alive_timeout,
        backlog=limits.backlog,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        log_config=uvicorn_log_config(args.log_format),
    )
    logging.getLogger("uvicorn.access").addFilter(RefusedRequestLogThrottle())
    server = DrainingServer(uvicorn_config, app.state.scheduler, config.shutdown_timeout)
    server.run()
    if server.load_error:
        raise SystemExit(f"tandem serve: {server.load_error}")
