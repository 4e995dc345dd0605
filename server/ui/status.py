"""GET /ui/status: what the web page shows, read from the scheduler and the metrics.

Cumulative counters (tokens generated, time-to-first-token sum and count, drafted and
accepted tokens by method) and gauges of this moment; the page keeps the time series
itself (in the browser) and turns counter differences into rates. Nothing here names
a prompt, an output, a key or another key's request: with API keys, the requests listed
are the caller's own (matched by key id), the rest is aggregate.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from scheduler.observer import RequestRecord
from server.auth import caller_key_id

METHOD_NAMES = {
    "pld": "prompt lookup",
    "suffix": "earlier requests",
    "draft": "draft model",
    "mtp": "MTP head",
    "dflash": "DFlash drafter",
    "eagle3": "EAGLE-3 drafter",
    "assistant": "assistant drafter",
}
OWN_REQUESTS = 12  # the caller's latest finished requests shown


def sample(metrics, name: str, **labels: str) -> float:
    """One sample of the app's Prometheus registry (0 when absent)."""
    value = metrics.registry.get_sample_value(name, {"model_name": metrics.model_name, **labels})
    return value or 0.0


def speculation(metrics, scheduler) -> dict:
    spec = metrics.totals
    drafts = spec.drafts
    return {
        "drafters": [{"id": d, "name": METHOD_NAMES.get(d, d)} for d in scheduler.drafters],
        "supported": scheduler.speculation_supported,
        "by_method": {
            method: {
                "name": METHOD_NAMES.get(method, method),
                "drafts": s.drafts,
                "drafted": s.draft_tokens,
                "accepted": s.accepted_tokens,
            }
            for method, s in sorted(spec.by_method.items())
        },
        "drafted": spec.draft_tokens,
        "accepted": spec.accepted_tokens,
        "per_position": [count / drafts if drafts else 0.0 for count in spec.accepted_per_position],
        "row_drafts_sum": sample(metrics, "tandem_spec_draft_tokens_per_row_sum"),
        "row_drafts_count": sample(metrics, "tandem_spec_draft_tokens_per_row_count"),
        "gate_trips": dict(spec.gate_trips),
    }


def own_request(record: RequestRecord) -> dict:
    """A finished request as the page lists it: counts and times, no content."""
    spec = record.speculation
    return {
        "id": record.request_id,
        "surface": record.surface,
        "finish_reason": record.finish_reason,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "completion_tokens": record.completion_tokens,
        "ttft_s": record.ttft_s,
        "e2e_s": record.e2e_s,
        "tokens_per_second": record.tokens_per_second,
        "drafted": spec.draft_tokens,
        "accepted": spec.accepted_tokens,
        "modes": list(record.modes),
    }


def own_requests(metrics, key: str | None) -> list[dict]:
    """The caller's latest finished requests, newest first; every request when the
    server has no keys (one shared scope)."""
    records = list(metrics.recent)  # appended on the engine thread: copy, then read
    mine = [r for r in records if key is None or r.scope == key]
    return [own_request(r) for r in reversed(mine[-OWN_REQUESTS:])]


def status(request: Request, device: str) -> dict:
    app = request.app.state
    scheduler, metrics, config = app.scheduler, app.metrics, app.config
    running = scheduler.num_running
    batched = scheduler.mode.value == "batched"
    counters = scheduler.counters
    return {
        "time": time.time(),
        "model": config.served_model_name,
        # whether images reach the model (a vision-language model), None while loading
        "vision": None if scheduler.model_info is None else scheduler.model_info.vision is not None,
        "state": "draining" if scheduler.draining else scheduler.state.value,
        "device": device,
        "blas": metrics.blas,
        "uptime_s": time.time() - metrics.started,
        "engine": "batched" if batched else "single stream",
        "keys": bool(config.api_keys),
        "requests": {
            "running": running,
            "waiting": scheduler.num_waiting,
            "finished": sum(metrics.finished.values()),
            "max_batch": scheduler.config.max_num_seqs,
        },
        "batch_size": running if batched else min(running, 1),
        "tokens": {
            "generated": counters.generated_tokens,
            "prompt": sample(metrics, "vllm:prompt_tokens_total"),
        },
        "ttft": {
            "sum": sample(metrics, "vllm:time_to_first_token_seconds_sum"),
            "count": sample(metrics, "vllm:time_to_first_token_seconds_count"),
        },
        "speculation": speculation(metrics, scheduler),
        "mode_switches": sum(counters.mode_switches.values()),
        "prefix_cache": {
            "queries": sample(metrics, "vllm:prefix_cache_queries_total"),
            "hits": sample(metrics, "vllm:prefix_cache_hits_total"),
        },
        "memory": dict(scheduler.memory),
        "yours": own_requests(metrics, caller_key_id(request.scope)),
    }


def status_endpoint(device: str):
    """The route handler; `device` is MLX's default device, named at start-up."""

    async def endpoint(request: Request) -> JSONResponse:
        return JSONResponse(status(request, device), headers={"Cache-Control": "no-store"})

    return endpoint
