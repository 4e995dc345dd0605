"""Load test an OpenAI-compatible server: `tandem bench serve`.

    tandem bench serve --base-url http://127.0.0.1:8000 --concurrency 1,2,4,8 \\
        --num-prompts 32 --max-tokens 128 --dataset mixed \\
        --output results.json --plot results.png

For each concurrency level, streams `--num-prompts` requests (closed loop: exactly
`concurrency` in flight; or Poisson arrivals at `--request-rate`, still capped at
`concurrency` in flight) and reports vLLM's figures under vLLM's key names: TTFT,
TPOT, ITL and E2EL statistics, request and token throughput, errors by type, and the
speculative-decoding counters' deltas from `/metrics` when the server exports them.

Works against any OpenAI-compatible server (Tandem, `mlx_lm.server`, `vllm-mlx
serve`, vLLM), so they can be measured the same way. It is bounded: only loopback
hosts unless `--allow-remote`, at most `--max-requests` requests and
`--max-duration` seconds in all, then it stops by itself.

This module runs the benchmark; its parts are bench/serve_settings.py (the flags),
serve_dataset.py (the prompts), serve_request.py (one streamed request), serve_level.py
(one concurrency level under the run's bounds) and serve_report.py (table, JSON, PNG).
"""

from __future__ import annotations

import asyncio
import datetime
import math
import platform
import time
from typing import Any

import httpx

from bench.blas_probe import server_blas
from bench.peer import peer_report, run_with_peers
from bench.serve_dataset import load_prompts, prompt_order
from bench.serve_level import Budget, Run, run_level
from bench.serve_report import (
    format_table,
    greedy_mismatches,
    greedy_summary,
    result_label,
    settings_summary,
    write_outputs,
)
from bench.serve_settings import Settings, parse_args, settings_from_args
from bench.stats import (
    aggregate,
    count_errors,
    counter_deltas,
    parse_counters,
    speculative_summary,
)


async def run_benchmark(settings: Settings) -> dict[str, Any]:
    """Resolve the model, optionally record solo greedy texts, then run each level
    with `/metrics` scraped around it."""
    prompts = load_prompts(settings.dataset)
    order = prompt_order(settings.num_prompts, len(prompts))
    budget = Budget(time.monotonic() + settings.max_duration_s, settings.max_requests)
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    async with make_client(settings) as client:
        model = settings.model or await first_model_id(client)
        run = Run(client, settings, model, prompts, budget)
        before_all = await scrape_counters(client)
        warmup = await warm_up(run, order)
        solo = await solo_texts(run, order)
        levels = []
        for concurrency in settings.concurrency:
            if budget.exhausted():
                break
            levels.append(await measure_level(run, order, concurrency, solo))
    return {
        "base_url": settings.base_url,
        "model": model,
        "dataset": settings.dataset,
        "endpoint": settings.endpoint,
        "settings": settings_summary(settings),
        "server": {"blas": server_blas(settings.base_url, before_all)},
        "client": {"platform": platform.platform(), "python": platform.python_version()},
        "started_at": started_at,
        "stopped_early": budget.stopped,
        "warmup": warmup,
        "greedy_check": greedy_summary(levels, solo) if settings.check_greedy else None,
        "levels": levels,
    }


async def warm_up(run: Run, order: list[int]) -> dict[str, Any] | None:
    """A few unmeasured requests, so the first level does not pay one-time costs
    (kernel compilation, lazy allocations). Their failures are reported, not fatal."""
    if not run.settings.warmup:
        return None
    done = await run_level(run, order[: run.settings.warmup], 1, "warmup")
    return {"requests": len(done.records), "errors": count_errors(done.records)}


async def measure_level(
    run: Run, order: list[int], concurrency: int, solo: dict[int, str] | None
) -> dict[str, Any]:
    before = await scrape_counters(run.client)
    done = await run_level(run, order, concurrency)
    after = await scrape_counters(run.client)
    rate = run.settings.request_rate
    level: dict[str, Any] = {
        "concurrency": concurrency,
        "request_rate": None if math.isinf(rate) else rate,
        "requests": len(done.records),
        **aggregate(done.records, done.duration_s),
    }
    level["speculative"] = (
        speculative_summary(counter_deltas(before, after)) if before and after else None
    )
    if solo is not None:
        level.update(greedy_mismatches(done.records, solo))
    return level


def make_client(settings: Settings) -> httpx.AsyncClient:
    """One pooled client; no proxies from the environment (they would be measured too)."""
    headers = {"anthropic-version": "2023-06-01"} if settings.endpoint == "messages" else {}
    if settings.api_key:
        headers.update(
            {"authorization": f"Bearer {settings.api_key}", "x-api-key": settings.api_key}
        )
    widest = max(settings.concurrency)
    return httpx.AsyncClient(
        base_url=settings.base_url,
        headers=headers,
        timeout=httpx.Timeout(settings.max_duration_s + 5, connect=10),
        limits=httpx.Limits(max_connections=widest + 2, max_keepalive_connections=widest + 2),
        trust_env=False,
    )


async def first_model_id(client: httpx.AsyncClient) -> str:
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise SystemExit(
            f"could not read a model id from GET /v1/models ({exc}); pass --model"
        ) from exc


async def scrape_counters(client: httpx.AsyncClient) -> dict | None:
    """Parsed `/metrics`, or None when the server has none (404) or it does not parse."""
    try:
        response = await client.get("/metrics")
        if response.status_code != 200:
            return None
        return parse_counters(response.text)
    except (httpx.HTTPError, ValueError):
        return None


async def solo_texts(run: Run, order: list[int]) -> dict[int, str] | None:
    """Each distinct prompt run alone (concurrency 1): the reference text under load."""
    if not run.settings.check_greedy:
        return None
    distinct = sorted(set(order))
    done = await run_level(run, distinct, 1, "solo (greedy check)")
    failed = [record for record in done.records if not record.success]
    if failed or len(done.records) < len(distinct):
        errors = sorted({record.error or "not run" for record in failed}) or [run.budget.stopped]
        raise SystemExit(f"--check-greedy: the solo runs did not all complete: {errors}")
    return {record.prompt_index: record.text for record in done.records}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print the table, write JSON/PNG; exit 1 on greedy mismatches."""
    settings = settings_from_args(parse_args(argv))
    if settings.peer == "none":
        result = asyncio.run(run_benchmark(settings))
    else:
        result = run_with_peers(settings, lambda run: asyncio.run(run_benchmark(run)))
    write_outputs(result, settings)
    print(format_table(result))
    if result.get("peers"):
        print(peer_report(result, result_label(result, settings), format_table))
    check = result["greedy_check"]
    if check and check["mismatches"]:
        raise SystemExit(
            f"--check-greedy: {check['mismatches']} of {check['checked']} responses differ "
            "from the same prompt run alone"
        )
    return result


if __name__ == "__main__":
    main()
