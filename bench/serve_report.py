"""What `tandem bench serve` reports: the greedy check's verdict, the table, JSON and PNG.

Why apart: turning finished levels into output does not depend on how they were run.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any

from bench.serve_settings import Settings
from bench.stats import RequestRecord

# --- greedy check ---------------------------------------------------------------------


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
