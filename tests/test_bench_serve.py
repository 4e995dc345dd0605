"""`tandem bench serve` / `tandem bench plot`: the latency maths on hand-made timings,
the harness against a real `tandem serve` process, and against small fake servers that
misbehave on purpose (load-dependent output, slowness, errors)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from bench import serve
from bench.blas_probe import is_loopback
from bench.serve_level import CANCELLED
from bench.stats import (
    PERCENTILES,
    RequestRecord,
    aggregate,
    counter_deltas,
    inter_token_latencies,
    parse_counters,
    percentile,
    speculative_summary,
    summarize,
    time_per_output_token,
)
from tests.live_server import serving
from tests.test_process import BLAS_PRELOAD, env_without, running_server

TANDEM = str(Path(sys.executable).parent / "tandem")
LATENCIES = ("ttft", "tpot", "itl", "e2el")
STAT_PREFIXES = ("mean", "median", "std", *(f"p{q}" for q in PERCENTILES))


# --- maths on hand-made timings -------------------------------------------------------


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for size in (1, 2, 3, 10, 101):
        values = list(rng.exponential(size=size))
        for q in (0, 1, 25, 50, 90, 95, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)


def test_percentile_of_nothing_is_an_error_not_zero():
    with pytest.raises(ValueError):
        percentile([], 50)


def test_tpot_is_decode_time_per_token_after_the_first():
    assert time_per_output_token(e2el=1.1, ttft=0.1, output_tokens=11) == pytest.approx(0.1)
    assert time_per_output_token(e2el=1.0, ttft=0.2, output_tokens=1) is None
    assert time_per_output_token(e2el=1.0, ttft=None, output_tokens=5) is None


def test_itl_has_one_gap_per_chunk_after_the_first():
    assert inter_token_latencies([0.5, 0.6, 0.75, 1.0]) == pytest.approx([0.1, 0.15, 0.25])
    assert inter_token_latencies([0.5]) == []
    record = RequestRecord(prompt_index=0, chunk_times=[0.2, 0.3, 0.5])
    assert record.ttft == 0.2
    assert record.itl == pytest.approx([0.1, 0.2])


def test_aggregate_uses_vllm_keys_and_counts_only_successful_requests():
    records = [
        RequestRecord(0, True, [0.1, 0.2, 0.4], e2el=0.5, input_tokens=10, output_tokens=5),
        RequestRecord(1, True, [0.3, 0.4], e2el=0.6, input_tokens=20, output_tokens=3),
        RequestRecord(2, False, [0.2], input_tokens=99, output_tokens=99, error="HTTP 503"),
        RequestRecord(3, False, error="ReadTimeout"),
        RequestRecord(4, False, error="HTTP 503"),
    ]
    result = aggregate(records, duration_s=2.0)
    assert (result["completed"], result["failed"]) == (2, 3)
    assert result["errors"] == {"HTTP 503": 2, "ReadTimeout": 1}
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (30, 8)
    assert result["request_throughput"] == pytest.approx(1.0)
    assert result["output_throughput"] == pytest.approx(4.0)
    assert result["total_token_throughput"] == pytest.approx(19.0)
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["p50_itl_ms"] == pytest.approx(np.percentile([100, 200, 100], 50))
    tpots = [(0.5 - 0.1) / 4 * 1000, (0.6 - 0.3) / 2 * 1000]
    assert result["mean_tpot_ms"] == pytest.approx(np.mean(tpots))
    assert result["std_e2el_ms"] == pytest.approx(np.std([500, 600]))
    assert result["p99_e2el_ms"] == pytest.approx(np.percentile([500, 600], 99))
    for name in LATENCIES:
        for prefix in STAT_PREFIXES:
            assert f"{prefix}_{name}_ms" in result


def test_latency_summary_of_no_samples_is_null():
    summary = summarize("itl", [])
    assert len(summary) == len(STAT_PREFIXES)
    assert set(summary.values()) == {None}


SPEC_METRICS_BEFORE = """\
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{model_name="m"} 10
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 40
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 20
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 6
"""

# Untyped families keep `_total` in the family name too; both shapes must parse.
SPEC_METRICS_AFTER = """\
vllm:spec_decode_num_drafts_total{model_name="m"} 30
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 120
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 80
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 27
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 16
# TYPE tandem_mode_switches_total counter
tandem_mode_switches_total{from="speculative",to="batched"} 3
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running 0
"""


def test_speculative_figures_come_from_counter_deltas_as_vllm_defines_them():
    before = parse_counters(SPEC_METRICS_BEFORE)
    after = parse_counters(SPEC_METRICS_AFTER)
    summary = speculative_summary(counter_deltas(before, after))
    assert summary["spec_decode_num_drafts"] == 20
    assert summary["spec_decode_num_draft_tokens"] == 80
    assert summary["spec_decode_num_accepted_tokens"] == 60
    assert summary["spec_decode_acceptance_rate"] == pytest.approx(60 / 80)
    assert summary["spec_decode_mean_acceptance_length"] == pytest.approx(1 + 60 / 20)
    assert summary["spec_decode_acceptance_rate_per_position"] == pytest.approx(
        {"0": 18 / 20, "1": 10 / 20}
    )
    assert summary["mode_switches"] == {"speculative->batched": 3}


def test_speculative_figures_are_null_without_speculative_counters():
    text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n"
    counters = parse_counters(text)
    assert speculative_summary(counter_deltas(counters, counters)) is None


# --- bounds: never leave the machine by accident --------------------------------------


@pytest.mark.parametrize(
    ("url", "loopback"),
    [
        ("http://127.0.0.1:8000", True),
        ("http://127.9.8.7:8000", True),
        ("http://localhost:8000", True),
        ("http://[::1]:8000", True),
        ("http://10.1.2.3:8000", False),
        ("http://0.0.0.0:8000", False),
        ("http://example.com", False),
    ],
)
def test_loopback_hosts(url, loopback):
    assert is_loopback(url) is loopback


def test_non_loopback_url_is_refused_before_any_connection(monkeypatch, tmp_path):
    def no_client(*args, **kwargs):
        raise AssertionError("a client was created for a refused URL")

    monkeypatch.setattr(serve.httpx, "AsyncClient", no_client)
    output = tmp_path / "r.json"
    argv = ["--base-url", "http://10.1.2.3:8000", "--model", "m", "--output", str(output)]
    with pytest.raises(SystemExit) as refused:
        serve.main(argv)
    assert "--allow-remote" in str(refused.value.code)
    assert not output.exists()


# --- against a real tandem serve process ----------------------------------------------


@pytest.fixture(scope="module")
def tandem_url(tiny_model_dir) -> Iterator[str]:
    # the levels repeat the same prompts: suffix decoding would draft each earlier answer
    # whole, leaving no gaps between tokens to measure
    args = [str(tiny_model_dir), "--served-model-name", "tiny", "--suffix-tokens-per-key", "0"]
    with running_server(args, env_without(*BLAS_PRELOAD)) as server:
        yield server.url


@pytest.fixture(scope="module")
def tandem_run(tandem_url, tmp_path_factory) -> tuple[dict, Path, Path]:
    """One greedy-checked chat run at concurrency 1 and 2, with JSON and PNG."""
    out = tmp_path_factory.mktemp("bench")
    output, plot = out / "tandem-chat.json", out / "tandem-chat.png"
    serve.main(
        ["--base-url", tandem_url, "--concurrency", "1,2", "--num-prompts", "4"]
        + ["--max-tokens", "16", "--dataset", "mixed", "--endpoint", "chat"]
        + ["--check-greedy", "--output", str(output), "--plot", str(plot)]
    )
    return json.loads(output.read_text()), output, plot


@pytest.mark.slow
def test_tandem_result_has_vllm_keys_and_sane_values(tandem_run):
    result, _, _ = tandem_run
    assert (result["model"], result["endpoint"], result["dataset"]) == ("tiny", "chat", "mixed")
    assert result["settings"]["concurrency"] == [1, 2]
    assert [level["concurrency"] for level in result["levels"]] == [1, 2]
    for level in result["levels"]:
        assert level["completed"] + level["failed"] == level["requests"] == 4
        assert level["failed"] == 0, level["errors"]
        assert level["errors"] == {}
        for name in LATENCIES:
            for prefix in STAT_PREFIXES:
                assert level[f"{prefix}_{name}_ms"] >= 0
        assert level["mean_ttft_ms"] <= level["mean_e2el_ms"]
        assert level["p99_ttft_ms"] <= level["p99_e2el_ms"]
        assert level["request_throughput"] > 0
        assert level["output_throughput"] > 0
        assert level["total_token_throughput"] > level["output_throughput"]
        assert level["duration_s"] > 0
        assert level["total_input_tokens"] > 0


@pytest.mark.slow
def test_tandem_output_tokens_come_from_usage_and_agree_across_levels(tandem_run):
    result, _, _ = tandem_run
    solo, pair = result["levels"]
    for level in (solo, pair):
        assert level["usage_reported"] == level["completed"]
        assert level["completed"] <= level["total_output_tokens"] <= 16 * level["completed"]
    # Same prompts, greedy, identical texts: the same token counts at every level.
    assert solo["total_output_tokens"] == pair["total_output_tokens"]
    assert solo["total_input_tokens"] == pair["total_input_tokens"]


@pytest.mark.slow
def test_check_greedy_passes_on_tandem(tandem_run):
    result, _, _ = tandem_run
    assert result["greedy_check"] == {"prompts": 4, "checked": 8, "mismatches": 0}
    assert all(level["greedy_mismatches"] == 0 for level in result["levels"])


@pytest.mark.slow
def test_result_states_the_servers_blas(tandem_run):
    from engines.platform.blas import computes_on_cpu, find_fast_blas

    result, _, _ = tandem_run
    blas = result["server"]["blas"]["blas"]
    preloads = not os.environ.get("TANDEM_NO_BLAS_PRELOAD")
    if sys.platform.startswith("linux") and not computes_on_cpu():
        assert blas == "gpu", result["server"]
    elif sys.platform.startswith("linux") and find_fast_blas() is not None and preloads:
        assert blas in ("openblas", "mkl"), result["server"]
    assert blas != "unknown" or not sys.platform.startswith("linux")


@pytest.mark.slow
def test_plot_option_writes_a_png(tandem_run):
    _, _, plot = tandem_run
    assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_completions_poisson_run_and_plot_overlay(tandem_url, tandem_run, tmp_path):
    _, first, _ = tandem_run
    second = tmp_path / "tandem-completions.json"
    serve.main(
        ["--base-url", tandem_url, "--concurrency", "2", "--num-prompts", "4"]
        + ["--max-tokens", "8", "--dataset", "chat", "--endpoint", "completions"]
        + ["--request-rate", "50", "--output", str(second)]
    )
    level = json.loads(second.read_text())["levels"][0]
    assert (level["completed"], level["request_rate"]) == (4, 50)
    comparison = tmp_path / "cmp.png"
    command = [TANDEM, "bench", "plot", str(first), str(second), "-o", str(comparison)]
    subprocess.run(command, check=True, capture_output=True, timeout=60)
    assert comparison.read_bytes().startswith(b"\x89PNG")


# --- against fake servers that misbehave on purpose -----------------------------------


@dataclass(frozen=True)
class Fake:
    """How the fake server answers. `load_dependent`: each response embeds a global
    request counter, as if concurrent requests leaked into each other."""

    load_dependent: bool = False
    chunk_delay_s: float = 0.0
    chunks: int = 4
    status: int = 200


def fake_app(fake: Fake) -> Starlette:
    counter = itertools.count()

    def words(body: dict) -> list[str]:
        digest = hashlib.sha256(json.dumps(body.get("messages") or body.get("prompt")).encode())
        tag = f"n{next(counter)}" if fake.load_dependent else digest.hexdigest()[:6]
        return [f" w{i}-{tag}" for i in range(fake.chunks)]

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def openai(request: Request):
        body = await request.json()
        if fake.status != 200:
            return JSONResponse({"error": {"type": "overloaded"}}, status_code=fake.status)
        chat = request.url.path.endswith("/chat/completions")
        return StreamingResponse(openai_events(words(body), chat), media_type="text/event-stream")

    async def openai_events(texts: list[str], chat: bool):
        if chat:
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for text in texts:
            if fake.chunk_delay_s:
                await asyncio.sleep(fake.chunk_delay_s)
            choice = {"index": 0, "delta": {"content": text}} if chat else {"text": text}
            yield sse({"choices": [choice]})
        usage = {"prompt_tokens": 7, "completion_tokens": 2 * len(texts)}
        yield sse({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    async def anthropic(request: Request):
        texts = words(await request.json())
        return StreamingResponse(anthropic_events(texts), media_type="text/event-stream")

    async def anthropic_events(texts: list[str]):
        yield sse({"type": "message_start", "message": {"usage": {"input_tokens": 7}}}, "x")
        for text in texts:
            yield sse({"type": "content_block_delta", "delta": {"text": text}}, "x")
        yield sse({"type": "message_delta", "usage": {"output_tokens": 3 * len(texts)}}, "x")
        yield sse({"type": "message_stop"}, "x")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/chat/completions", openai, methods=["POST"]),
            Route("/v1/completions", openai, methods=["POST"]),
            Route("/v1/messages", anthropic, methods=["POST"]),
        ]
    )


def sse(payload: dict, event: str | None = None) -> str:
    head = f"event: {payload['type']}\n" if event else ""
    return f"{head}data: {json.dumps(payload)}\n\n"


@contextmanager
def fake_server(fake: Fake) -> Iterator[str]:
    """The fake app under uvicorn in a background thread on a free loopback port."""
    with serving(fake_app(fake)) as url:
        yield url


def run_harness(url: str, tmp_path: Path, *extra: str) -> dict:
    output = tmp_path / "fake.json"
    argv = ["--base-url", url, "--num-prompts", "4", "--max-tokens", "8", "--output", str(output)]
    serve.main([*argv, *extra])
    return json.loads(output.read_text())


def test_check_greedy_fails_when_output_depends_on_load(tmp_path):
    with fake_server(Fake(load_dependent=True)) as url:
        with pytest.raises(SystemExit) as failed:
            run_harness(url, tmp_path, "--concurrency", "1,2", "--check-greedy")
    assert failed.value.code not in (0, None)
    assert "differ" in str(failed.value.code)
    result = json.loads((tmp_path / "fake.json").read_text())
    assert result["greedy_check"]["mismatches"] == 8
    assert result["levels"][0]["greedy_mismatch_examples"]


def test_check_greedy_passes_on_a_consistent_server_with_completions(tmp_path):
    with fake_server(Fake()) as url:
        result = run_harness(url, tmp_path, "--concurrency", "1,2", "--check-greedy")
        result_completions = run_harness(
            url, tmp_path, "--concurrency", "2", "--endpoint", "completions"
        )
    assert result["greedy_check"]["mismatches"] == 0
    assert result["model"] == "fake"
    level = result_completions["levels"][0]
    assert level["completed"] == 4


def test_output_tokens_come_from_usage_not_chunk_count(tmp_path):
    with fake_server(Fake(chunks=5)) as url:
        result = run_harness(url, tmp_path, "--concurrency", "2")
    level = result["levels"][0]
    assert level["total_output_tokens"] == 4 * 10
    assert level["total_input_tokens"] == 4 * 7
    assert level["usage_reported"] == 4
    assert level["p50_itl_ms"] is not None
    assert level["speculative"] is None  # the fake has no /metrics


def test_anthropic_messages_stream_reads_usage_from_message_delta(tmp_path):
    with fake_server(Fake(chunks=3)) as url:
        result = run_harness(url, tmp_path, "--concurrency", "2", "--endpoint", "messages")
    level = result["levels"][0]
    assert level["completed"] == 4
    assert level["total_output_tokens"] == 4 * 9
    assert level["total_input_tokens"] == 4 * 7


def test_http_errors_are_counted_by_status(tmp_path):
    with fake_server(Fake(status=503)) as url:
        result = run_harness(url, tmp_path, "--concurrency", "2")
    level = result["levels"][0]
    assert (level["completed"], level["failed"]) == (0, 4)
    assert level["errors"] == {"HTTP 503": 4}
    assert level["mean_ttft_ms"] is None


def test_max_requests_caps_the_whole_run(tmp_path):
    with fake_server(Fake()) as url:
        result = run_harness(url, tmp_path, "--concurrency", "1,2,4", "--max-requests", "6")
    assert result["warmup"] == {"requests": 1, "errors": {}}
    assert [level["requests"] for level in result["levels"]] == [4, 1]
    assert result["stopped_early"] == "max-requests reached"


def test_max_duration_stops_a_slow_server_by_itself(tmp_path):
    slow = Fake(chunks=50, chunk_delay_s=0.1)  # 5 s per request
    with fake_server(slow) as url:
        started = time.monotonic()
        result = run_harness(
            url, tmp_path, "--concurrency", "2,4", "--max-duration", "1", "--warmup", "0"
        )
        elapsed = time.monotonic() - started
    assert elapsed < 4
    assert result["stopped_early"] == "max-duration reached"
    assert [level["concurrency"] for level in result["levels"]] == [2]
    assert result["levels"][0]["errors"] == {CANCELLED: 2}
