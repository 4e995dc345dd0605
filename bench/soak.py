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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from bench.blas_probe import is_loopback, listening_pid
from bench.serve import Prompt, first_model_id, load_prompts, normalize_base_url
from bench.stats import parse_counters

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# Refusals a server under deliberate overload may give; recorded, not counted as failures.
EXPECTED_ERRORS = frozenset({"HTTP 503 server_overloaded"})
DISCONNECTED = "disconnected"
MIB = 1 << 20


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


@dataclass(frozen=True)
class Plan:
    """One request: where it goes, how long it is, whether it is abandoned early."""

    endpoint: str
    stream: bool
    max_tokens: int
    prompt: Prompt
    disconnect_after: int | None  # data events to read before hanging up

    @property
    def kind(self) -> str:
        return f"{self.endpoint}/{'stream' if self.stream else 'json'}/{self.max_tokens}"


@dataclass(frozen=True)
class MemorySample:
    t: float
    rss_bytes: int | None
    mlx_active: float | None
    mlx_cache: float | None
    mlx_peak: float | None
    running: float | None
    waiting: float | None


@dataclass
class Tally:
    """What the workers did; single-threaded (asyncio), so no locks."""

    started: int = 0
    ok: int = 0
    disconnects: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)

    def record(self, plan: Plan, outcome: str | None) -> None:
        self.kinds[plan.kind] = self.kinds.get(plan.kind, 0) + 1
        if outcome is None:
            self.ok += 1
        elif outcome == DISCONNECTED:
            self.disconnects += 1
        else:
            self.errors[outcome] = self.errors.get(outcome, 0) + 1


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


# --- command line -----------------------------------------------------------------------


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


# --- one request ------------------------------------------------------------------------


def choose_plan(rng: random.Random, settings: Settings, prompts: list[Prompt]) -> Plan:
    stream = rng.random() < settings.stream_fraction
    long = rng.random() < settings.long_fraction
    max_tokens = settings.long_tokens if long else settings.short_tokens
    disconnect_after = None
    if stream and rng.random() < settings.disconnect_rate:
        disconnect_after = rng.randint(1, max(1, max_tokens // 2))
    return Plan(
        endpoint="chat" if rng.random() < settings.chat_fraction else "completions",
        stream=stream,
        max_tokens=max_tokens,
        prompt=rng.choice(prompts),
        disconnect_after=disconnect_after,
    )


def request_body(plan: Plan, model: str) -> dict[str, Any]:
    """`ignore_eos` so a request runs to its `max_tokens`: lengths stay as planned."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": plan.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": plan.stream,
    }
    if plan.endpoint == "chat":
        body["messages"] = list(plan.prompt.messages)
    else:
        body["prompt"] = plan.prompt.text
    return body


async def run_one(client: httpx.AsyncClient, plan: Plan, model: str) -> str | None:
    """None when the request completed; DISCONNECTED when we hung up; else the error."""
    body = request_body(plan, model)
    try:
        async with client.stream("POST", ENDPOINTS[plan.endpoint], json=body) as response:
            if response.status_code != 200:
                return await error_key(response)
            if plan.stream:
                return await read_stream(response, plan.disconnect_after)
            await response.aread()
            return body_error(response)
    except httpx.HTTPError as exc:
        return type(exc).__name__


async def read_stream(response: httpx.Response, disconnect_after: int | None) -> str | None:
    """Read SSE events to `[DONE]`, or return early (closing the connection) to disconnect."""
    events = 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return None
        error = event_error(data)
        if error:
            return error
        events += 1
        if disconnect_after is not None and events >= disconnect_after:
            return DISCONNECTED
    return "stream ended without [DONE]"


def event_error(data: str) -> str | None:
    """The error an SSE data line carries (mid-stream failure), if any."""
    try:
        event = json.loads(data)
    except ValueError:
        return "malformed SSE data"
    if not isinstance(event, dict):
        return "malformed SSE data"
    error = event.get("error")
    return f"stream error {error.get('type')}" if isinstance(error, dict) else None


def body_error(response: httpx.Response) -> str | None:
    try:
        return None if "choices" in response.json() else "response without choices"
    except ValueError:
        return "malformed JSON response"


async def error_key(response: httpx.Response) -> str:
    await response.aread()
    try:
        kind = response.json()["error"]["type"]
    except (ValueError, KeyError, TypeError):
        kind = "non-OpenAI error body"
    return f"HTTP {response.status_code} {kind}"


async def worker(soak: Soak) -> None:
    while soak.more():
        plan = choose_plan(soak.rng, soak.settings, soak.prompts)
        soak.tally.started += 1
        soak.tally.record(plan, await run_one(soak.client, plan, soak.model))


# --- memory and gauges ------------------------------------------------------------------


def read_rss(pid: int | None) -> int | None:
    """Resident set size of `pid` in bytes (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gauge(counters: dict | None, name: str, **labels: str) -> float | None:
    """Sum of the samples of `name` whose labels include `labels`; None if absent."""
    if counters is None:
        return None
    values = [
        value
        for (sample, sample_labels), value in counters.items()
        if sample == name and labels.items() <= dict(sample_labels).items()
    ]
    return sum(values) if values else None


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


# --- verdict ----------------------------------------------------------------------------


def memory_summary(
    samples: list[MemorySample], settings: Settings, after_drain: dict[str, Any]
) -> dict[str, Any]:
    """First, after warm-up, last and max of RSS under load (the samples up to the
    duration), or of MLX active memory when RSS cannot be read (not Linux, or another
    user's process). Warm-up and last are both taken under load, so they compare."""
    source = "rss_bytes" if any(s.rss_bytes is not None for s in samples) else "mlx_active"
    series = [
        (s.t, getattr(s, source))
        for s in samples
        if getattr(s, source) is not None and s.t <= settings.duration_s
    ]
    slack = settings.rss_slack_mb * MIB
    rule = f"last <= warm * {1 + settings.rss_tolerance:.2f} + {settings.rss_slack_mb:g} MB"
    if not series:
        return {"source": source, "rule": rule, "flat": None, "samples": len(samples)}
    warm = next((value for t, value in series if t >= settings.warmup_s), series[-1][1])
    last = series[-1][1]
    return {
        "source": source,
        "first": series[0][1],
        "warm": warm,
        "last": last,
        "max": max(value for _, value in series),
        "after_drain": after_drain.get(source),
        "warmup_s": settings.warmup_s,
        "rule": rule,
        "flat": last <= warm * (1 + settings.rss_tolerance) + slack,
        "samples": len(series),
    }


def verdict(tally: Tally, drain: dict[str, Any], memory: dict[str, Any]) -> dict[str, Any]:
    unexpected = {k: n for k, n in tally.errors.items() if k not in EXPECTED_ERRORS}
    reasons = []
    if unexpected:
        reasons.append(f"unexpected errors: {unexpected}")
    if not drain["leak_free"]:
        reasons.append(f"after drain running={drain['running']} waiting={drain['waiting']}")
    if not memory["flat"]:
        reasons.append(f"memory not flat ({memory['rule']})")
    return {
        "passed": not reasons,
        "unexpected_errors": unexpected,
        "leak_free": drain["leak_free"],
        "memory_flat": memory["flat"],
        "reasons": reasons,
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


# --- output -----------------------------------------------------------------------------


def mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f} MB"


def format_summary(report: dict[str, Any]) -> str:
    requests, drain, memory = report["requests"], report["drain"], report["memory"]
    result = report["verdict"]
    lines = [
        f"soak: {report['server']['model']} at {report['server']['base_url']} "
        f"(pid {report['server']['pid']}), {report['elapsed_s']:.0f} s, "
        f"concurrency {report['settings']['concurrency']}",
        f"requests: {requests['started']} started, {requests['ok']} ok, "
        f"{requests['failed']} failed, {requests['disconnects']} disconnects made",
    ]
    lines += [f"  {count:6d}  {error}" for error, count in requests["errors"].items()]
    lines.append(
        f"after drain ({drain['seconds']:.1f} s): running={drain['running']} "
        f"waiting={drain['waiting']} -> {'no leak' if drain['leak_free'] else 'LEAK'}"
    )
    lines.append(
        f"memory ({memory['source']}, {memory['samples']} samples): "
        f"first {mb(memory.get('first'))}, after {memory.get('warmup_s', 0):.0f} s warm-up "
        f"{mb(memory.get('warm'))}, last {mb(memory.get('last'))}, max {mb(memory.get('max'))}, "
        f"after drain {mb(memory.get('after_drain'))}"
    )
    lines.append(f"  flat if {memory['rule']}: {memory['flat']}")
    lines.append("PASS" if result["passed"] else "FAIL: " + "; ".join(result["reasons"]))
    return "\n".join(lines)


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
