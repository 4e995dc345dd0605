"""Prometheus /metrics and /v1/stats: vLLM-compatible names, counters that move by
exactly the right amounts through every engine, and a real Prometheus scraping a
live server."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL_NAME, make_client, start_scheduler
from tests.test_process import ServerProcess, free_port

CODE = "def add(a, b):\n    return a + b\n" * 3


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without model_name): value} from an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def value(snapshot, name: str, **labels) -> float:
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(after, before, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


async def scrape(client) -> dict:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return samples(response.text)


async def test_counters_move_by_exactly_the_served_amounts(spec_scheduler):
    async with make_client(spec_scheduler) as client:
        before = await scrape(client)
        payloads = [
            {"prompt": CODE, "max_tokens": 40, "temperature": 0, "enable_pld": False},
            {
                "prompt": CODE,
                "max_tokens": 40,
                "temperature": 0,
                "enable_draft": False,
                "logit_bias": {"11": 20},
                "ignore_eos": True,
            },
            {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0.7, "seed": 1},
        ]
        solo = [(await client.post("/v1/completions", json=p)).json() for p in payloads]
        batched = await asyncio.gather(
            *(
                client.post(
                    "/v1/completions",
                    json={
                        "prompt": f"Hello {i}",
                        "max_tokens": 25,
                        "ignore_eos": True,
                        "temperature": 0,
                    },
                )
                for i in range(3)
            )
        )
        batched = [r.json() for r in batched]
        after = await scrape(client)
    bodies = solo + batched
    generated = sum(b["usage"]["completion_tokens"] for b in bodies)
    prompts = sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert delta(after, before, "vllm:generation_tokens_total") == generated
    assert delta(after, before, "vllm:prompt_tokens_total") == prompts
    finished = sum(
        delta(after, before, "vllm:request_success_total", finished_reason=r)
        for r in ("stop", "length")
    )
    assert finished == len(bodies)

    drafted = sum(b["speculation"]["draft_tokens"] for b in bodies)
    accepted = sum(b["speculation"]["accepted_tokens"] for b in bodies)
    drafts = sum(b["speculation"]["drafts"] for b in bodies)
    assert drafted > 0 and 0 < accepted <= drafted
    assert delta(after, before, "vllm:spec_decode_num_draft_tokens_total") == drafted
    assert delta(after, before, "vllm:spec_decode_num_accepted_tokens_total") == accepted
    assert delta(after, before, "vllm:spec_decode_num_drafts_total") == drafts
    per_position = sum(
        delta(after, before, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(16)
    )
    assert per_position == accepted
    methods = ("draft", "pld", "suffix")  # suffix: the same prompts asked again
    by_method_drafted = sum(
        delta(after, before, "tandem_spec_draft_tokens_total", method=m) for m in methods
    )
    by_method_accepted = sum(
        delta(after, before, "tandem_spec_accepted_tokens_total", method=m) for m in methods
    )
    assert (by_method_drafted, by_method_accepted) == (drafted, accepted)
    assert delta(after, before, "tandem_spec_accepted_tokens_total", method="pld") > 0
    assert delta(after, before, "tandem_spec_accepted_tokens_total", method="draft") > 0

    assert (
        delta(
            after, before, "tandem_mode_switches_total", **{"from": "speculative", "to": "batched"}
        )
        >= 1
    )
    assert delta(after, before, "tandem_batch_size_count") >= 1
    assert delta(after, before, "vllm:time_to_first_token_seconds_count") == len(bodies)
    assert delta(after, before, "vllm:e2e_request_latency_seconds_count") == len(bodies)
    itl = delta(after, before, "vllm:inter_token_latency_seconds_count")
    assert 0 < itl <= generated - len(bodies)
    assert (
        value(after, "tandem_engine_mode", mode="speculative")
        + value(after, "tandem_engine_mode", mode="batched")
        == 1
    )
    assert value(after, "vllm:num_requests_running") == 0


async def test_errors_and_disconnect_counters(spec_scheduler):
    async with make_client(spec_scheduler) as client:
        before = await scrape(client)
        await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": -3})
        await client.post("/v1/completions", json={"prompt": "hi", "model": "nope"})
        after = await scrape(client)
    assert delta(after, before, "tandem_request_errors_total", kind="invalid_request_error") == 2


async def test_stats_endpoint_reports_mode_acceptance_and_switches(spec_scheduler):
    async with make_client(spec_scheduler) as client:
        await client.post(
            "/v1/completions", json={"prompt": CODE, "max_tokens": 30, "temperature": 0}
        )
        await asyncio.gather(
            *(
                client.post(
                    "/v1/completions", json={"prompt": CODE, "max_tokens": 30 + i, "temperature": 0}
                )
                for i in range(2)
            )
        )
        stats = (await client.get("/v1/stats")).json()
    assert stats["mode"] in ("speculative", "batched")
    spec = stats["speculation"]
    assert spec["draft_tokens"] >= spec["accepted_tokens"] > 0
    assert 0 < spec["acceptance_rate"] <= 1
    assert spec["mean_acceptance_length"] >= 1
    assert set(spec["by_method"]) <= {"draft", "pld", "suffix"}
    assert stats["requests"]["finished"]
    assert "speculative->batched" in stats["mode_switches"]


async def test_metrics_can_be_disabled_and_keyed(tiny_model_dir):
    scheduler = start_scheduler(tiny_model_dir)
    try:
        async with make_client(scheduler, metrics=False) as client:
            assert (await client.get("/metrics")).status_code == 404
        async with make_client(scheduler, api_keys=("api",), metrics_api_keys=("scrape",)) as c:
            assert (await c.get("/metrics")).status_code == 401
            ok = await c.get("/metrics", headers={"Authorization": "Bearer scrape"})
            assert ok.status_code == 200
            assert (
                await c.get("/v1/models", headers={"Authorization": "Bearer scrape"})
            ).status_code == 401
    finally:
        scheduler.stop()


def prometheus_binary() -> str | None:
    found = shutil.which("prometheus")
    if found is None and os.environ.get("CI"):
        pytest.fail("prometheus must be installed in CI (.ci/run installs it)")
    return found


def test_real_prometheus_scrapes_acceptance_rate(tiny_model_dir, perturbed_draft_dir, tmp_path):
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("prometheus binary not installed locally")
    server = ServerProcess(
        [
            str(tiny_model_dir),
            "--draft-model",
            str(perturbed_draft_dir),
            "--served-model-name",
            MODEL_NAME,
            "--assume-draft-costs",  # whether steps draft must not depend on this box's speed
        ],
        dict(os.environ),
    )
    prom_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: tandem\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{server.port}']\n"
    )
    prom = None
    try:
        server.wait_healthy()
        prom = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(3):
            response = httpx.post(
                f"{server.url}/v1/completions",
                json={
                    "prompt": CODE,
                    "max_tokens": 40,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logit_bias": {"11": 20},
                },
                timeout=60,
            )
            assert response.status_code == 200
        query = (
            "sum(vllm:spec_decode_num_accepted_tokens_total) / "
            "sum(vllm:spec_decode_num_draft_tokens_total)"
        )
        speculation = httpx.get(f"{server.url}/v1/stats").json()["speculation"]
        assert speculation["draft_tokens"] > 0, speculation
        expected = speculation["acceptance_rate"]
        deadline = time.monotonic() + 30
        result = None
        while time.monotonic() < deadline:
            try:
                answer = httpx.get(
                    f"http://127.0.0.1:{prom_port}/api/v1/query",
                    params={"query": query},
                    timeout=5,
                ).json()
                data = answer["data"]["result"]
                if data and abs(float(data[0]["value"][1]) - expected) < 1e-9:
                    result = float(data[0]["value"][1])
                    break
            except (httpx.TransportError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        assert result is not None, f"Prometheus never reported {expected}: {speculation}"
        assert 0 < result <= 1
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(10)
        server.stop()


def test_exposition_parses_and_names_are_bounded(spec_scheduler):
    from server.metrics import Metrics

    metrics = Metrics("m", spec_scheduler, "openblas")
    families = {f.name for f in text_string_to_metric_families(metrics.exposition().decode())}
    for name in (
        "vllm:spec_decode_num_drafts",
        "vllm:num_requests_running",
        "vllm:time_to_first_token_seconds",
        "tandem_engine_mode",
        "tandem_blas_info",
        "vllm:prefix_cache_hits",
        "tandem_memory_bytes",
    ):
        assert name in families
    assert Path(__file__).exists()


def test_dashboard_metric_list_matches_the_live_exposition(spec_scheduler):
    """The Grafana dashboard is checked against EXPORTED_METRICS; this keeps that list
    equal to what /metrics really exports."""
    from server.metrics import Metrics
    from tests.test_deploy import EXPORTED_METRICS

    exposition = Metrics("m", spec_scheduler, "openblas").exposition().decode()
    exported = set()
    for family in text_string_to_metric_families(exposition):
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation timestamps, not metrics of ours
        suffix = "_total" if family.type == "counter" else ""
        exported.add(family.name + suffix)
    assert exported == set(EXPORTED_METRICS)


@pytest.mark.parametrize(("num_draft_tokens", "k_max"), [(4, 8), (10, 10)])
async def test_labelled_series_exist_at_zero_from_startup(tiny_model_dir, num_draft_tokens, k_max):
    """Dashboards and rate() queries need every bounded series before its first use:
    each draft position up to the largest k a request may ask for, both switch ways."""
    from scheduler import Scheduler, SchedulerConfig

    fresh = Scheduler(SchedulerConfig(model=str(tiny_model_dir), num_draft_tokens=num_draft_tokens))
    async with make_client(fresh) as client:
        snapshot = await scrape(client)
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    positions = {dict(labels)["position"] for name, labels in snapshot if name == per_pos}
    assert positions == {str(p) for p in range(k_max)}
    for source, target in (("speculative", "batched"), ("batched", "speculative")):
        key = ("tandem_mode_switches_total", (("from", source), ("to", target)))
        assert snapshot[key] == 0
    assert all(snapshot[(per_pos, (("position", str(p)),))] == 0 for p in range(k_max))
