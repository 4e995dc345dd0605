"""Soak test a running server: `tandem bench soak`.

    tandem bench soak --base-url http://127.0.0.1:8000 --duration 600 \\
        --concurrency 16 --disconnect-rate 0.1 --output soak.json

Keeps `--concurrency` requests in flight for `--duration` seconds: a mix of chat and
completions, streaming and not, short and long `max_tokens`, and a fraction of the
streaming ones abandoned mid-stream (the client disconnects, which must cancel them).
Meanwhile it samples the server's memory: the RSS of the process listening on the port
(Linux /proc) and `tandem_memory_bytes` from /metrics. Then it lets the server drain
and reports errors by type, disconnects made, requests still running or waiting after
the drain (a leak if not 0), and memory over time with a verdict: memory is flat if the
last RSS under load is at most the RSS after warm-up x (1 + tolerance) + slack.

It starts nothing itself, only talks to a loopback server, stops by itself at the
duration (and at `--max-requests`), and exits 1 when the verdict fails.

`tandem bench soak matrix` is the other soak: random server settings x cache kinds,
in-process (bench/soak_matrix.py).

This module runs the soak; its parts are bench/soak_settings.py (the flags),
soak_workload.py (the requests and their tally), soak_memory.py (memory samples and the
flatness rule) and soak_report.py (the verdict and the summary).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx

from bench.blas_probe import listening_pid
from bench.serve import first_model_id
from bench.serve_dataset import Prompt, load_prompts
from bench.soak_memory import MemorySample, gauge, memory_summary, read_rss
from bench.soak_report import format_summary, verdict
from bench.soak_settings import Settings, parse_args, settings_from_args
from bench.soak_workload import Tally, choose_plan, run_one
from bench.stats import parse_counters


@dataclass
class Soak:
    """What the workers and the sampler share for one run."""

    client: httpx.AsyncClient
    settings: Settings
    model: str
    prompts: list[Prompt]
    pid: int | None
    rng: random.Random
    started: float
    deadline: float
    tally: Tally = field(default_factory=Tally)
    samples: list[MemorySample] = field(default_factory=list)

    def more(self) -> bool:
        """Whether a worker may start another request."""
        return time.monotonic() < self.deadline and self.tally.started < self.settings.max_requests


# --- workers ----------------------------------------------------------------------------


async def worker(soak: Soak) -> None:
    while soak.more():
        plan = choose_plan(soak.rng, soak.settings, soak.prompts)
        soak.tally.started += 1
        soak.tally.record(plan, await run_one(soak.client, plan, soak.model))


# --- memory and gauges ------------------------------------------------------------------


async def scrape(client: httpx.AsyncClient) -> dict | None:
    try:
        response = await client.get("/metrics")
        return parse_counters(response.text) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def sample_memory(soak: Soak) -> MemorySample:
    counters = await scrape(soak.client)
    return MemorySample(
        t=round(time.monotonic() - soak.started, 3),
        rss_bytes=read_rss(soak.pid),
        mlx_active=gauge(counters, "tandem_memory_bytes", kind="active"),
        mlx_cache=gauge(counters, "tandem_memory_bytes", kind="cache"),
        mlx_peak=gauge(counters, "tandem_memory_bytes", kind="peak"),
        running=gauge(counters, "vllm:num_requests_running"),
        waiting=gauge(counters, "vllm:num_requests_waiting"),
    )


async def sampler(soak: Soak) -> None:
    """Sample until the load ends (the task is cancelled after the workers finish)."""
    while True:
        soak.samples.append(await sample_memory(soak))
        await asyncio.sleep(soak.settings.sample_interval_s)


async def wait_for_drain(soak: Soak) -> dict[str, Any]:
    """Poll the gauges until nothing runs or waits, or the drain timeout passes."""
    start = time.monotonic()
    while True:
        sample = await sample_memory(soak)
        idle = sample.running == 0 and sample.waiting == 0
        if idle or time.monotonic() - start > soak.settings.drain_timeout_s:
            break
        await asyncio.sleep(0.2)
    return {
        "seconds": round(time.monotonic() - start, 3),
        "running": sample.running,
        "waiting": sample.waiting,
        "leak_free": idle,
        "sample": asdict(sample),
    }


# --- the run ----------------------------------------------------------------------------


def make_client(settings: Settings) -> httpx.AsyncClient:
    """Pooled for the workers plus the sampler; no proxies from the environment."""
    headers = {}
    if settings.api_key:
        headers = {"authorization": f"Bearer {settings.api_key}", "x-api-key": settings.api_key}
    width = settings.concurrency + 2
    return httpx.AsyncClient(
        base_url=settings.base_url,
        headers=headers,
        timeout=httpx.Timeout(settings.duration_s + settings.drain_timeout_s, connect=10),
        limits=httpx.Limits(max_connections=width, max_keepalive_connections=width),
        trust_env=False,
    )


async def load(soak: Soak) -> float:
    """Run the workers to the duration, then let in-flight requests finish (bounded)."""
    sampling = asyncio.create_task(sampler(soak))
    workers = [asyncio.create_task(worker(soak)) for _ in range(soak.settings.concurrency)]
    _, late = await asyncio.wait(
        workers, timeout=soak.settings.duration_s + soak.settings.drain_timeout_s
    )
    if late:
        soak.tally.errors["cancelled at drain timeout"] = len(late)
    for task in [*late, sampling]:
        task.cancel()
    results = await asyncio.gather(*workers, sampling, return_exceptions=True)
    elapsed = time.monotonic() - soak.started
    for result in results:
        if isinstance(result, Exception):  # a bug in the harness, not a server error
            raise result
    return elapsed


async def run_soak(settings: Settings) -> dict[str, Any]:
    prompts = [prompt for name in settings.datasets for prompt in load_prompts(name)]
    async with make_client(settings) as client:
        model = settings.model or await first_model_id(client)
        port = httpx.URL(settings.base_url).port or 80
        pid = listening_pid(port) if sys.platform.startswith("linux") else None
        started = time.monotonic()
        soak = Soak(
            client=client,
            settings=settings,
            model=model,
            prompts=prompts,
            pid=pid,
            rng=random.Random(settings.seed),
            started=started,
            deadline=started + settings.duration_s,
        )
        elapsed = await load(soak)
        drain = await wait_for_drain(soak)
    memory = memory_summary(soak.samples, settings, drain["sample"])
    return {
        "settings": {
            **asdict(replace(settings, api_key=None)),
            "output": str(settings.output) if settings.output else None,
        },
        "server": {"base_url": settings.base_url, "model": model, "pid": pid},
        "elapsed_s": round(elapsed, 3),
        "requests": {
            "started": soak.tally.started,
            "ok": soak.tally.ok,
            "failed": sum(soak.tally.errors.values()),
            "errors": dict(sorted(soak.tally.errors.items())),
            "disconnects": soak.tally.disconnects,
            "by_kind": dict(sorted(soak.tally.kinds.items())),
        },
        "drain": drain,
        "memory": memory,
        "memory_samples": [asdict(sample) for sample in soak.samples],
        "verdict": verdict(soak.tally, drain, memory),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print the summary, write the JSON; exit 1 when the verdict fails.
    `tandem bench soak matrix ...` runs the randomized in-process soak instead."""
    if argv and argv[0] == "matrix":
        from bench.soak_matrix import main as matrix

        return matrix(argv[1:])
    settings = settings_from_args(parse_args(argv))
    report = asyncio.run(run_soak(settings))
    if settings.output:
        settings.output.parent.mkdir(parents=True, exist_ok=True)
        settings.output.write_text(json.dumps(report, indent=2) + "\n")
    print(format_summary(report))
    if not report["verdict"]["passed"]:
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    main()
