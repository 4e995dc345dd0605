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
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import platform
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.blas_probe import is_loopback, server_blas
from bench.peer import add_peer_arguments, peer_report, run_with_peers
from bench.stats import (
    RequestRecord,
    aggregate,
    count_errors,
    counter_deltas,
    parse_counters,
    speculative_summary,
)

DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN_DATASETS = ("echo", "novel", "mixed", "chat", "code-edit", "code-novel")
ENDPOINTS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
}
CANCELLED = "Cancelled (max-duration)"


@dataclass(frozen=True)
class Prompt:
    """One dataset line in both shapes: chat messages and one completion string."""

    messages: tuple[dict[str, str], ...]
    text: str


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


@dataclass
class Budget:
    """The run's hard bounds: a wall-clock deadline and a request allowance."""

    deadline: float
    requests_left: int
    stopped: str | None = None

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def exhausted(self) -> bool:
        """True (recording why) once either bound is reached."""
        if self.remaining() <= 0:
            self.stopped = self.stopped or "max-duration reached"
        elif self.requests_left <= 0:
            self.stopped = self.stopped or "max-requests reached"
        return self.stopped is not None

    def take(self) -> bool:
        """Claim one request, unless the run is over."""
        if self.exhausted():
            return False
        self.requests_left -= 1
        return True


@dataclass
class Chunk:
    """What one SSE event contributes: content text, token counts, or an error."""

    text: str = ""
    input_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None


@dataclass
class Run:
    """What every request of one benchmark run shares."""

    client: httpx.AsyncClient
    settings: Settings
    model: str
    prompts: list[Prompt]
    budget: Budget


@dataclass
class LevelRun:
    concurrency: int
    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0


# --- command line -----------------------------------------------------------------------


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


# --- dataset --------------------------------------------------------------------------


def dataset_path(name: str) -> Path:
    return DATA_DIR / f"{name}.jsonl" if name in BUILTIN_DATASETS else Path(name)


def load_prompts(name: str) -> list[Prompt]:
    path = dataset_path(name)
    if not path.is_file():
        raise SystemExit(f"dataset not found: {path}")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    prompts = [prompt_from_line(json.loads(line)) for line in lines]
    if not prompts:
        raise SystemExit(f"dataset is empty: {path}")
    return prompts


def prompt_from_line(line: dict[str, Any]) -> Prompt:
    """`{"messages": [...]}` (chat turns) or `{"prompt": "..."}` (one user message)."""
    if "messages" in line:
        messages = tuple({"role": m["role"], "content": m["content"]} for m in line["messages"])
        return Prompt(messages, "\n\n".join(m["content"] for m in messages))
    if "prompt" in line:
        return Prompt(({"role": "user", "content": line["prompt"]},), line["prompt"])
    raise SystemExit(f"dataset line has neither 'messages' nor 'prompt': {line}")


def prompt_order(num_prompts: int, dataset_size: int) -> list[int]:
    """Cycle the dataset to reach `num_prompts`."""
    return [index % dataset_size for index in range(num_prompts)]


# --- one request ----------------------------------------------------------------------


def request_body(settings: Settings, model: str, prompt: Prompt, seed: int | None) -> dict:
    """The streaming request for the chosen endpoint."""
    body: dict[str, Any] = {"model": model, "max_tokens": settings.max_tokens, "stream": True}
    body["temperature"] = settings.temperature
    if settings.endpoint == "messages":
        system = [m["content"] for m in prompt.messages if m["role"] == "system"]
        body["messages"] = [m for m in prompt.messages if m["role"] != "system"]
        if system:
            body["system"] = "\n\n".join(system)
        return body
    if settings.endpoint == "chat":
        body["messages"] = list(prompt.messages)
    else:
        body["prompt"] = prompt.text
    body["stream_options"] = {"include_usage": True}
    if seed is not None:
        body["seed"] = seed
    if settings.ignore_eos:
        body["ignore_eos"] = True
    return body


def read_chunk(endpoint: str, data: dict[str, Any]) -> Chunk:
    """Content and usage of one decoded SSE `data:` payload."""
    if endpoint == "messages":
        return read_anthropic_event(data)
    if isinstance(data.get("error"), dict):
        return Chunk(error=f"stream error: {data['error'].get('type', 'error')}")
    text = ""
    for choice in data.get("choices") or []:
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            text += delta.get("content") or delta.get("reasoning_content") or ""
        else:
            text += choice.get("text") or ""
    usage = data.get("usage") or {}
    return Chunk(text, usage.get("prompt_tokens"), usage.get("completion_tokens"))


def read_anthropic_event(data: dict[str, Any]) -> Chunk:
    """Anthropic streams: text in `content_block_delta`, prompt tokens in
    `message_start`, the final output token count in `message_delta`."""
    kind = data.get("type")
    if kind == "content_block_delta":
        delta = data.get("delta") or {}
        return Chunk(text=delta.get("text") or delta.get("thinking") or "")
    if kind == "message_start":
        usage = (data.get("message") or {}).get("usage") or {}
        return Chunk(input_tokens=usage.get("input_tokens"))
    if kind == "message_delta":
        usage = data.get("usage") or {}
        return Chunk(
            input_tokens=usage.get("input_tokens"), output_tokens=usage.get("output_tokens")
        )
    if kind == "error":
        return Chunk(error=f"stream error: {(data.get('error') or {}).get('type', 'error')}")
    return Chunk()


async def send_request(
    client: httpx.AsyncClient, settings: Settings, body: dict, prompt_index: int
) -> RequestRecord:
    """Stream one request, timing each content chunk's arrival. Failures become an
    error type on the record (`HTTP 503`, an exception class), never an exception."""
    record = RequestRecord(prompt_index=prompt_index)
    start = time.perf_counter()
    try:
        async with client.stream("POST", ENDPOINTS[settings.endpoint], json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}"
                return record
            await read_stream(response, settings.endpoint, record, start)
    except Exception as exc:  # every failure is a data point, counted by type
        record.error = type(exc).__name__
        return record
    record.e2el = time.perf_counter() - start
    if record.error is None:
        record.success = True
        if not record.usage_reported:
            record.output_tokens = len(record.chunk_times)
    return record


async def read_stream(
    response: httpx.Response, endpoint: str, record: RequestRecord, start: float
) -> None:
    parts: list[str] = []
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            break
        chunk = read_chunk(endpoint, json.loads(payload))
        if chunk.error:
            record.error = chunk.error
            break
        if chunk.text:
            record.chunk_times.append(time.perf_counter() - start)
            parts.append(chunk.text)
        if chunk.input_tokens is not None:
            record.input_tokens = chunk.input_tokens
        if chunk.output_tokens is not None:
            record.output_tokens = chunk.output_tokens
            record.usage_reported = True
    record.text = "".join(parts)


# --- one level ------------------------------------------------------------------------


async def run_level(run: Run, order: list[int], concurrency: int, label: str = "") -> LevelRun:
    """Issue `order` with at most `concurrency` in flight (closed loop, or Poisson
    arrivals when a request rate is set). In-flight requests still running at the
    deadline are cancelled and counted as failed."""
    settings, budget = run.settings, run.budget
    rng = random.Random(settings.seed)
    slots = asyncio.Semaphore(concurrency)
    progress = make_progress(len(order), label or f"concurrency {concurrency}")
    tasks: list[tuple[int, asyncio.Task]] = []
    start = time.perf_counter()
    for number, index in enumerate(order):
        if not await wait_for_slot(slots, budget, arrival_gap(settings, rng)):
            break
        if not budget.take():
            slots.release()
            break
        seed = None if settings.temperature == 0 else settings.seed + number
        body = request_body(settings, run.model, run.prompts[index], seed)
        request = send_request(run.client, settings, body, index)
        tasks.append((index, asyncio.create_task(in_slot(request, slots, progress.update))))
    records = await collect(tasks, budget)
    progress.close()
    return LevelRun(concurrency, records, time.perf_counter() - start)


def arrival_gap(settings: Settings, rng: random.Random) -> float:
    """Exponential gaps make Poisson arrivals; no gap in a closed loop."""
    return 0.0 if math.isinf(settings.request_rate) else rng.expovariate(settings.request_rate)


async def wait_for_slot(slots: asyncio.Semaphore, budget: Budget, gap: float) -> bool:
    """Sleep until the next arrival, then until a slot frees; False at the deadline."""
    if gap > 0:
        await asyncio.sleep(min(gap, budget.remaining()))
    try:
        await asyncio.wait_for(slots.acquire(), timeout=budget.remaining())
    except asyncio.TimeoutError:
        budget.stopped = budget.stopped or "max-duration reached"
        return False
    return True


async def in_slot(
    request: Awaitable[RequestRecord], slots: asyncio.Semaphore, done: Callable[[int], Any]
) -> RequestRecord:
    try:
        return await request
    finally:
        slots.release()
        done(1)


async def collect(tasks: list[tuple[int, asyncio.Task]], budget: Budget) -> list[RequestRecord]:
    if not tasks:
        return []
    _, pending = await asyncio.wait([task for _, task in tasks], timeout=budget.remaining())
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    if pending:
        budget.stopped = budget.stopped or "max-duration reached"
    return [
        RequestRecord(prompt_index=index, error=CANCELLED) if task in pending else task.result()
        for index, task in tasks
    ]


# --- the whole run --------------------------------------------------------------------


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


# --- greedy check ---------------------------------------------------------------------


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


def greedy_mismatches(records: list[RequestRecord], solo: dict[int, str]) -> dict[str, Any]:
    """Successful responses whose text differs from the prompt's solo text."""
    wrong = [r for r in records if r.success and r.text != solo[r.prompt_index]]
    examples = [
        {
            "prompt_index": r.prompt_index,
            "expected": solo[r.prompt_index][:200],
            "got": r.text[:200],
        }
        for r in wrong[:3]
    ]
    return {"greedy_mismatches": len(wrong), "greedy_mismatch_examples": examples}


def greedy_summary(levels: list[dict[str, Any]], solo: dict[int, str] | None) -> dict[str, Any]:
    return {
        "prompts": len(solo or {}),
        "checked": sum(level["completed"] for level in levels),
        "mismatches": sum(level["greedy_mismatches"] for level in levels),
    }


# --- output ---------------------------------------------------------------------------


def settings_summary(settings: Settings) -> dict[str, Any]:
    summary = asdict(settings)
    for key in ("base_url", "model", "dataset", "endpoint", "api_key", "output", "plot"):
        summary.pop(key)
    summary["concurrency"] = list(settings.concurrency)
    summary["request_rate"] = None if math.isinf(settings.request_rate) else settings.request_rate
    summary["api_key_set"] = settings.api_key is not None
    return summary


TABLE_COLUMNS = (
    ("conc", "concurrency", "{:d}"),
    ("done", "completed", "{:d}"),
    ("fail", "failed", "{:d}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("TTFT p50", "p50_ttft_ms", "{:.1f}"),
    ("TTFT p99", "p99_ttft_ms", "{:.1f}"),
    ("TPOT p50", "p50_tpot_ms", "{:.1f}"),
    ("ITL p50", "p50_itl_ms", "{:.1f}"),
    ("ITL p99", "p99_itl_ms", "{:.1f}"),
    ("E2EL p50", "p50_e2el_ms", "{:.0f}"),
)


def format_table(result: dict[str, Any]) -> str:
    """One row per concurrency level; latencies in ms."""
    columns = list(TABLE_COLUMNS)
    if any(level.get("speculative") for level in result["levels"]):
        columns.append(("accept", "acceptance_rate", "{:.2f}"))
    if result.get("greedy_check"):
        columns.append(("mismatch", "greedy_mismatches", "{:d}"))
    rows = [[header for header, _, _ in columns]]
    for level in result["levels"]:
        values = {**level, "acceptance_rate": acceptance(level)}
        rows.append([cell(values.get(key), spec) for _, key, spec in columns])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = [
        "  ".join(text.rjust(width) for text, width in zip(row, widths, strict=True))
        for row in rows
    ]
    blas = result["server"]["blas"]
    lines.insert(
        0,
        f"{result['model']} at {result['base_url']} ({result['endpoint']}, "
        f"{result['dataset']}); server BLAS: {blas['blas']}",
    )
    for level in result["levels"]:
        if level["errors"]:
            counts = ", ".join(f"{kind} x{count}" for kind, count in level["errors"].items())
            lines.append(f"errors at concurrency {level['concurrency']}: {counts}")
    if result.get("stopped_early"):
        lines.append(f"stopped early: {result['stopped_early']}")
    return "\n".join(lines)


def acceptance(level: dict[str, Any]) -> float | None:
    return (level.get("speculative") or {}).get("spec_decode_acceptance_rate")


def cell(value: Any, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def write_outputs(result: dict[str, Any], settings: Settings) -> None:
    if settings.output:
        settings.output.parent.mkdir(parents=True, exist_ok=True)
        settings.output.write_text(json.dumps(result, indent=2) + "\n")
    if settings.plot:
        from bench.plot import plot_results, with_peers

        plot_results(with_peers(result_label(result, settings), result), settings.plot)


def result_label(result: dict[str, Any], settings: Settings) -> str:
    return settings.output.stem if settings.output else result["model"]


def make_progress(total: int, description: str):
    """tqdm when installed (silent when stderr is not a terminal), else a counter."""
    try:
        from tqdm import tqdm
    except ImportError:
        return LineCounter(total, description)
    return tqdm(total=total, desc=description, unit="req", file=sys.stderr, disable=None)


@dataclass
class LineCounter:
    """A one-line `done/total` counter on stderr, for when tqdm is missing."""

    total: int
    description: str
    done: int = 0

    def update(self, amount: int) -> None:
        self.done += amount
        if sys.stderr.isatty():
            print(f"\r{self.description}: {self.done}/{self.total}", end="", file=sys.stderr)

    def close(self) -> None:
        if sys.stderr.isatty():
            print(file=sys.stderr)


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
