"""`tandem bench outside`: what it asks guidellm for, and what it reads of guidellm's JSON
report (made by hand here: guidellm is not installed with Tandem)."""

from __future__ import annotations

import json

import pytest

from bench import outside_harness
from bench.outside_harness import guidellm_command, level_row, median_ratios, parse_args, table


def stats(mean: float, median: float, count: int = 20) -> dict:
    return {"successful": {"mean": mean, "median": median, "count": count}}


def report(tok_s: float, ttft: float, itl: float, tokens: float = 128.0) -> dict:
    """The parts of a guidellm 0.8 report the harness reads."""
    metrics = {
        "output_tokens_per_second": stats(tok_s, tok_s * 0.9),
        "time_to_first_token_ms": stats(ttft * 1.2, ttft),
        "inter_token_latency_ms": stats(itl * 1.1, itl),
        "output_token_count": stats(tokens, tokens),
        "request_totals": {"successful": 20, "errored": 0, "incomplete": 0, "total": 20},
    }
    return {"benchmarks": [{"metrics": metrics, "duration": 240.0}]}


def test_a_level_row_takes_mean_throughput_and_median_latencies():
    row = level_row(report(tok_s=12.0, ttft=500.0, itl=70.0))
    assert row["output_tok_s"] == 12.0
    assert row["ttft_ms_p50"] == 500.0 and row["ttft_ms_mean"] == pytest.approx(600.0)
    assert row["itl_ms_p50"] == 70.0
    assert row["output_tokens_per_request"] == 128.0
    assert (row["requests"], row["errored"], row["seconds"]) == (20, 0, 240.0)


def test_a_level_with_no_successful_request_has_no_numbers():
    empty = report(1.0, 1.0, 1.0)
    for name in ("output_tokens_per_second", "time_to_first_token_ms"):
        empty["benchmarks"][0]["metrics"][name] = {"successful": {"count": 0}}
    row = level_row(empty)
    assert row["output_tok_s"] is None and row["ttft_ms_p50"] is None


def test_the_table_gives_tandem_over_mlx_lm_per_round_and_level():
    rows = [
        {"round": 1, "server": "tandem", "users": 1, **level_row(report(11.0, 400.0, 80.0))},
        {"round": 1, "server": "mlx_lm", "users": 1, **level_row(report(10.0, 500.0, 64.0))},
        {"round": 2, "server": "mlx_lm", "users": 1, **level_row(report(10.0, 500.0, 80.0))},
        {"round": 2, "server": "tandem", "users": 1, **level_row(report(9.0, 450.0, 90.0))},
        {"round": 1, "server": "tandem", "users": 4, **level_row(report(20.0, 900.0, 150.0))},
    ]
    lines = table(rows)
    assert "| 1 | 1 | 1.10x | 0.80x | 1.25x |" in lines
    assert "| 2 | 1 | 0.90x | 0.90x | 1.12x |" in lines
    assert not any(line.startswith("| 1 | 4 | ") and "x |" in line for line in lines)
    assert median_ratios(rows) == {1: pytest.approx(1.0)}


def test_both_servers_get_the_same_guidellm_level(tmp_path):
    args = parse_args(["--requests", "5", "--max-seconds", "60", "--temperature", "0"])
    command = guidellm_command(
        "guidellm", "http://127.0.0.1:1", "bench", "/models/m", args, 4, tmp_path / "o.json"
    )
    given = dict(zip(command[2::2], command[3::2], strict=False))
    assert json.loads(given["--profile"]) == {"kind": "concurrent", "streams": 4}
    backend = json.loads(given["--backend"])
    assert backend["extras"] == {"body": {"temperature": 0.0}}
    assert json.loads(given["--data"])["prompt_tokens"] == 512
    constraints = [json.loads(command[i + 1]) for i, a in enumerate(command) if a == "--constraint"]
    assert {"kind": "max_requests", "count": 5} in constraints
    assert {"kind": "max_duration", "seconds": 60.0} in constraints
    untouched = parse_args(["--temperature", "none"])
    backend = json.loads(guidellm_command("g", "u", "m", "t", untouched, 1, tmp_path)[3])
    assert "extras" not in backend  # each server's own default temperature


def test_without_guidellm_it_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(outside_harness, "ROOT", tmp_path)
    monkeypatch.setattr(outside_harness.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="pip install guidellm"):
        outside_harness.guidellm_executable(None)
