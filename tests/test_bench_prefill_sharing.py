"""`tandem bench prefill-sharing --short`: a real `tandem serve` of the tiny model, a
decoding stream and a long prompt arriving beside it, and mlx-lm's prefill in process.

The tiny model's numbers say nothing about speed (per-step overheads dominate); the
test checks the report is whole and that the stream kept getting tokens while the long
prompt prefilled (before the change it waited for the whole prefill: one gap, no chunk).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench.prefill_sharing import window_rates

ROOT = Path(__file__).resolve().parents[1]
# the short form's bound: 8 s on an idle 2-core CPU (tiny model already built)
SHORT_S = 60


def test_short_form_reports_the_stream_decoding_through_the_prefill(tmp_path):
    out, text_out = tmp_path / "result.json", tmp_path / "result.txt"
    command = [sys.executable, "-m", "tandem.cli", "bench", "prefill-sharing", "--short"]
    started = time.monotonic()
    result = subprocess.run(
        [*command, "--output", str(out), "--text-output", str(text_out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SHORT_S * 3,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert elapsed < SHORT_S, f"the short form took {elapsed:.0f}s"
    report = json.loads(out.read_text())
    assert report["model"]["name"] == "agent-tiny"
    assert report["mlx_lm"]["dtype"] == ["mlx.core.float32"]
    assert report["tandem"]["blas"]["blas"] and report["mlx_lm"]["blas"]
    assert len(report["load_average_start"]) == 3
    assert report["settings"]["prompt_tokens"] == 2600
    assert report["tandem"]["command"][-2:] == ["--prefix-cache-disk-gb", "0"]

    server, shared = report["tandem"], report["tandem"]["shared"]
    assert server["alone_ttft_s"] > 0 and shared["ttft_s"] > 0
    assert server["shared_over_alone"] == shared["ttft_s"] / server["alone_ttft_s"]
    assert shared["error"] is None
    assert len(shared["arrivals_s"]) == shared["chunks"]
    assert server["prefill_step_size"] > 0 and server["batch_prefill_step_size"] > 0
    # the stream read its chunks before, during and after the long prompt's prefill
    assert shared["gaps"]["before"] >= 9 and shared["gaps"]["after"] >= 19, shared
    assert shared["chunks_during_prefill"] >= 2, shared
    assert shared["gaps"]["during"] >= 2, shared
    gaps = shared["median_gap_s"]
    assert all(gaps[k] > 0 for k in ("all", "before", "during", "after")), gaps
    rates = shared["tokens_per_s"]  # each window's tokens over its time: a real rate
    assert all(rates[k] > 0 for k in ("before", "during", "after")), rates
    assert shared["largest_gap_s"] >= shared["largest_during_s"] > 0
    # the stream's largest gap is shorter than the whole prefill it shared the engine with
    assert shared["largest_during_s"] < shared["ttft_s"], shared
    assert shared["largest_over_median"] == shared["largest_gap_s"] / gaps["all"]

    mlx = report["mlx_lm"]
    assert sorted(int(k) for k in mlx["ttft_s_by_step"]) == [256, 512, 1024, 2048]
    assert mlx["best_ttft_s"] == min(mlx["ttft_s_by_step"].values()) > 0
    assert report["lone_over_mlx_best"] == server["alone_ttft_s"] / mlx["best_ttft_s"]

    text = text_out.read_text()
    assert text.strip() == result.stdout.strip()
    for needle in (
        "BLAS: server",
        "load average",
        "float32",
        "shared / alone",
        "tokens/s",
        "targets",
    ):
        assert needle in text, needle


def test_window_rates_count_each_windows_tokens_over_its_time():
    arrivals = [0.0, 1.0, 2.0, 3.0, 5.0, 6.0, 6.5]
    texts = ["a ", "b c ", "d ", "e f g ", "h ", "i j ", "k "]
    rates = window_rates(arrivals, texts, 2.5, 5.5, lambda text: len(text.split()))
    assert rates == {"before": 3 / 2.0, "during": 4 / 3.0, "after": 3 / 1.5}
    assert window_rates([0.0], ["a"], 1.0, 2.0, len) == {
        "before": None,
        "during": None,
        "after": None,
    }
