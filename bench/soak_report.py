"""The soak's verdict (unexpected errors, leaks, memory growth) and its printed summary.

Why apart: judging and printing a finished report does not depend on how it was run.
"""

from __future__ import annotations

from typing import Any

from bench.soak_memory import MIB
from bench.soak_workload import Tally

# Refusals a server under deliberate overload may give; recorded, not counted as failures.
EXPECTED_ERRORS = frozenset({"HTTP 503 server_overloaded"})


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
