"""`tandem bench soak` against a real `tandem serve`: more clients than batch slots,
some hanging up mid-stream, and afterwards nothing left running or waiting, no server
errors, and memory sampled throughout."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from bench import soak
from bench.soak_memory import MIB, MemorySample, memory_summary
from bench.soak_report import EXPECTED_ERRORS, format_summary, verdict
from bench.soak_settings import Settings, parse_args, settings_from_args
from bench.soak_workload import Tally
from tests.test_process import BLAS_PRELOAD, ServerProcess, env_without, running_server

REPORT_KEYS = {
    "settings",
    "server",
    "elapsed_s",
    "requests",
    "drain",
    "memory",
    "memory_samples",
    "verdict",
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """Eight batch slots for sixteen clients: half of them wait in the queue."""
    args = [str(tiny_model_dir), "--served-model-name", "tiny", "--max-num-seqs", "8"]
    with running_server(args, env_without(*BLAS_PRELOAD)) as proc:
        yield proc


def run_soak(server: ServerProcess, seconds: float) -> dict:
    argv = [
        "--base-url", server.url,
        "--duration", str(seconds),
        "--concurrency", "16",
        "--disconnect-rate", "0.2",
        "--long-tokens", "128",
        "--sample-interval", "0.5",
    ]  # fmt: skip
    return asyncio.run(soak.run_soak(settings_from_args(parse_args(argv))))


def assert_soak_is_clean(report: dict) -> None:
    assert set(report) == REPORT_KEYS
    requests = report["requests"]
    # Queue-full refusals would be acceptable (and are recorded); nothing else is.
    assert report["verdict"]["unexpected_errors"] == {}, requests["errors"]
    assert set(requests["errors"]) <= EXPECTED_ERRORS
    assert requests["ok"] > 0
    assert requests["disconnects"] > 0, "the soak should have hung up on some streams"
    assert requests["started"] == requests["ok"] + requests["failed"] + requests["disconnects"]
    assert {kind.split("/")[1] for kind in requests["by_kind"]} == {"stream", "json"}
    drain = report["drain"]
    assert (drain["running"], drain["waiting"]) == (0, 0), drain
    assert drain["leak_free"]
    samples = report["memory_samples"]
    assert len(samples) >= 5
    assert any(sample["running"] for sample in samples), "never saw a request running"
    assert all(sample["rss_bytes"] for sample in samples), "RSS of the server not read"
    memory = report["memory"]
    assert memory["source"] == "rss_bytes"
    assert memory["first"] <= memory["max"] and memory["last"] <= memory["max"]
    assert memory["flat"] is not None and "rule" in memory
    assert report["verdict"]["leak_free"]


@pytest.fixture(scope="module")
def short_report(server) -> dict:
    return run_soak(server, 20)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_short_soak_with_disconnects_leaves_no_requests_behind(server, short_report):
    assert_soak_is_clean(short_report)
    assert short_report["server"]["pid"] == server.proc.pid


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_minute_soak_memory_is_flat_after_warm_up(server):
    report = run_soak(server, 60)
    assert_soak_is_clean(report)
    assert report["verdict"]["memory_flat"], report["memory"]
    assert report["verdict"]["passed"], report["verdict"]["reasons"]


@pytest.mark.slow
def test_summary_fits_one_screen_and_states_the_rule(short_report):
    text = format_summary(short_report)
    assert len(text.splitlines()) <= 24
    assert "flat if last <= warm * 1.10 + 50 MB" in text
    assert "disconnects made" in text


def test_refuses_a_remote_server_before_any_request():
    with pytest.raises(SystemExit, match="non-loopback"):
        settings_from_args(parse_args(["--base-url", "http://example.com:8000"]))


# --- the verdict on hand-made numbers -----------------------------------------------------


def settings(**overrides) -> Settings:
    argv = ["--duration", "100", "--warmup", "20"]
    return replace(settings_from_args(parse_args(argv)), **overrides)


def rss_series(*megabytes: float) -> list[MemorySample]:
    """One sample every 10 s."""
    return [
        MemorySample(10.0 * i, int(mb * MIB), None, None, None, 0, 0)
        for i, mb in enumerate(megabytes)
    ]


def test_memory_is_flat_within_ten_percent_plus_50_mb_of_the_warm_up_rss():
    flat = memory_summary(rss_series(100, 400, 1000, 1000, 1140, 1149), settings(), {})
    assert (flat["first"], flat["warm"], flat["last"]) == (
        100 * MIB,
        1000 * MIB,
        1149 * MIB,
    )
    assert flat["flat"]
    growing = memory_summary(rss_series(100, 400, 1000, 1100, 1200), settings(), {})
    assert not growing["flat"]
    assert growing["max"] == 1200 * MIB


def test_samples_after_the_duration_are_not_the_last_under_load():
    summary = memory_summary(rss_series(*[100] * 11, 5000), settings(), {})
    assert summary["last"] == 100 * MIB and summary["flat"]


def test_leaks_and_unexpected_errors_fail_the_verdict_but_queue_full_does_not():
    memory = {"flat": True, "rule": "r"}
    clean = {"leak_free": True, "running": 0, "waiting": 0}
    overloaded = Tally(errors={"HTTP 503 server_overloaded": 3})
    assert verdict(overloaded, clean, memory)["passed"]
    leaked = {"leak_free": False, "running": 1, "waiting": 0}
    assert verdict(Tally(), leaked, memory)["reasons"] == ["after drain running=1 waiting=0"]
    broken = Tally(errors={"HTTP 500 server_error": 1})
    assert verdict(broken, clean, memory)["unexpected_errors"] == {"HTTP 500 server_error": 1}
