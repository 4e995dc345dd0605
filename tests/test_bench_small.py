"""The small speed probes of issue 42, run on the tiny model as a user runs them
(`python -m bench.suffix_repeat`, `python -m bench.packed_cost`, `python -m
bench.decoding_copy`): the reports are whole, the suffix probe's answers equal plain
decoding's, only the asking key's own index drafts, and only with copies on does the
newcomer start from the decoding request's cache. The tiny model's timings say nothing
about speed; bench/README.md has real runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(*args: str) -> str:
    command = [sys.executable, "-m", *args]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_suffix_repeat_drafts_from_the_same_key_only_and_stays_plain(tiny_model_dir):
    out = run_bench("bench.suffix_repeat", str(tiny_model_dir), "--prompt-tokens", "200")
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    *requests, summary = lines
    served = {r["request"]: r for r in requests if "suffix" not in r}
    plain = {r["request"]: r for r in requests if r.get("suffix") == "off"}
    assert set(served) == {"first", "again", "together-1", "together-2", "other-key"}
    assert set(plain) == {"first", "again", "together-1", "together-2"}
    assert summary["blas"] and summary["model"] == str(tiny_model_dir)
    assert summary["identical_to_plain"] is True, summary
    for name in ("again", "together-1", "together-2"):
        drafted, accepted = served[name]["drafted_accepted"].get("suffix", [0, 0])
        assert accepted > 0 and served[name]["cached_tokens"] > 0, served[name]
    for result in [served["first"], served["other-key"], *plain.values()]:
        assert "suffix" not in result["drafted_accepted"], result
    assert served["other-key"]["cached_tokens"] == 0  # k1's prefix is not k2's


@pytest.mark.slow
def test_packed_cost_reports_every_chunk_size(tiny_model_dir):
    out = run_bench("bench.packed_cost", str(tiny_model_dir), "--context", "64", "--sizes", "8,16")
    assert "BLAS:" in out and "decode step alone:" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["8", "16"]
    assert all(float(row[2]) > 0 for row in rows)


def test_decoding_copy_serves_the_newcomer_only_with_copies_on(tiny_model_dir):
    out = run_bench("bench.decoding_copy", str(tiny_model_dir), "--tokens", "300")
    on, off, summary = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert on["copies"] is True and off["copies"] is False
    assert on["prefill_follows"] == {"copied": 1} and off["prefill_follows"] == {}
    assert on["newcomer_cached_tokens"] >= 300 and off["newcomer_cached_tokens"] == 0
    assert on["leader_median_gap_before_ms"] > 0
    assert summary["identical_tokens_on_and_off"] is True, summary
    assert summary["blas"] and summary["prompt_tokens"] == 300
