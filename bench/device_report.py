"""The device check's summary and plots, read from each stage's own results.

`bench.device` runs the stages; this turns what they wrote into the lines a session
pastes into the benchmark docs (per stage: whether it ran, and its headline numbers
against mlx-lm) and into two PNGs (every hybrid run's throughput, TTFT and ITL against
concurrency; every verify grid).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any


def environment() -> dict[str, Any]:
    """Device, versions and machine, as the summary's first lines state them."""
    import mlx.core as mx

    versions = {}
    for name in ("mlx", "mlx-cuda-13", "mlx-cuda-12", "mlx-cpu", "mlx-metal", "mlx-lm",
                 "transformers", "tandem-serve"):  # fmt: skip
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {
        "device": str(mx.default_device()),
        "gpu": gpu_name(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "versions": versions,
        "commit": git_commit(),
    }


def gpu_name() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def git_commit() -> str | None:
    """The commit the check ran (the device gets no .git: then DEVICE_CHECK_COMMIT)."""
    if os.environ.get("DEVICE_CHECK_COMMIT"):
        return os.environ["DEVICE_CHECK_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


# --- summary --------------------------------------------------------------------------


def summarise(report: dict, stages: list) -> str:
    env = report["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    lines = [
        f"tandem device check ({report['profile']}): {env['device']}, GPU {env['gpu'] or 'none'}",
        f"python {env['python']}, {versions}; commit {env['commit'] or 'unknown'}",
        f"{report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget",
        "",
        "stages:",
    ]
    lines += [f"  {s.name:16} {s.status}" + (f" ({s.seconds} s)" if s.seconds else "")
              for s in stages]  # fmt: skip
    for stage in stages:
        if not isinstance(stage.result, dict):
            continue
        kind = stage.name.split("-")[0]
        describe = {
            "models": models_lines,
            "verify": verify_lines,
            "single": single_lines,
            "hybrid": hybrid_lines,
            "tests": tests_lines,
            "drafters": drafters_lines,
        }[kind]
        lines += ["", f"== {stage.name}", *describe(stage.result)]
    return "\n".join(lines)


def drafters_lines(result: dict) -> list[str]:
    from bench.drafter_cost import lines

    return lines(result)


def models_lines(result: dict) -> list[str]:
    return [
        f"{name}: {f'{count / 1e9:.2f}B' if count >= 1e8 else f'{count / 1e6:.1f}M'} "
        f"parameters, bfloat16, vocabulary {result['vocab']}"
        for name, count in result.get("parameters", {}).items()
    ]


def verify_lines(result: dict) -> list[str]:
    from bench.device_verify import table

    rows = sorted({cell["rows"] for cell in result["cells"]})
    tokens = sorted({cell["tokens"] for cell in result["cells"]})
    return table(result, rows, tokens).splitlines()


def single_lines(result: dict) -> list[str]:
    """Per prompt set: Tandem's draft against mlx-lm's best fixed k, plain decoding,
    and whether every output equalled mlx-lm's."""
    lines = []
    for set_name, configs in result.items():
        if set_name == "per_run" or "mlx-lm" not in configs:
            continue
        peers = {c: v["tok_s"] for c, v in configs.items() if c.startswith("mlx-lm+draft")}
        best = max(peers, key=peers.get) if peers else None
        parts = [f"mlx-lm {configs['mlx-lm']['tok_s']:.1f} tok/s"]
        parts += [f"{c.split()[-1]}: {rate:.1f}" for c, rate in peers.items()]
        lines.append(f"{set_name}: " + ", ".join(parts))
        for config in ("plain", "draft"):
            if config not in configs:
                continue
            row = configs[config]
            text = (
                f"  tandem {config}: {row['tok_s']:.1f} tok/s ({row['ratio_vs_mlx_lm']:.2f}x mlx-lm"
            )
            if best and config == "draft":
                speedup = row["tok_s"] / peers[best]
                text += f", {speedup:.2f}x mlx-lm+draft at its best {best.split()[-1]}"
                accepted = sum(row["accepted"].values())
                drafted = sum(row["drafted"].values())
                text += f"; accepted {accepted}/{drafted}"
            text += ")"
            if row["greedy_mismatches"]:
                text += f"  {row['greedy_mismatches']} output(s) differ from mlx-lm's"
            lines.append(text)
    return lines


def hybrid_lines(result: dict) -> list[str]:
    """Per level: every mode's and peer's output tok/s and the hybrid's ratios."""
    rows = {**result.get("modes", {}), **result.get("peers", {})}
    names = list(rows)
    levels = sorted(int(level) for level in next(iter(rows.values()))["levels"])
    lines = [f"{'c':>3} " + " ".join(f"{name:>14}" for name in names) + "  (output tok/s)"]
    comparison = result.get("peer_comparison", {}).get("hybrid", {})
    for level in levels:
        rates = [level_row(rows[name], level).get("output_throughput") or 0.0 for name in names]
        line = f"{level:>3} " + " ".join(f"{rate:>14.1f}" for rate in rates)
        cmp = comparison.get(str(level)) or comparison.get(level)
        if cmp and cmp.get("output_throughput_ratio"):
            line += f"  hybrid / {cmp['best_peer']} {cmp['output_throughput_ratio']:.2f}x"
            if not cmp["same_output_tokens"]:
                line += " (UNEQUAL WORK)"
        control = next((m for m in ("hybrid-nodraft", "batch-only") if m in rows), None)
        if control and "hybrid" in rows:
            base = level_row(rows[control], level).get("output_throughput")
            ours = level_row(rows["hybrid"], level).get("output_throughput")
            if base and ours:
                line += f", / {control} {ours / base:.2f}x"
        lines.append(line)
    switch = result.get("switch")
    if switch:
        lines.append(
            f"switch: newcomer TTFT {switch['second_request_ttft_ms']:.0f} ms, first stream's "
            f"max gap {switch['max_gap_over_median']:.2f}x its median"
        )
    return lines


def level_row(data: dict, level: int) -> dict:
    levels = data["levels"]
    return levels.get(str(level)) or levels.get(level) or {}


def tests_lines(result: dict) -> list[str]:
    lines = [
        f"{result['passed']} passed, {result['failures']} failed, {result['errors']} errors, "
        f"{result['skipped']} skipped of {result['tests']}"
        + (
            " (stopped at its time limit: the tests it finished)"
            if result.get("unfinished")
            else ""
        )
    ]
    lines += [f"  FAILED {test}" for test in result["failed"]]
    return lines


# --- plots --------------------------------------------------------------------------


def plot_hybrid(stages: list, path: Path) -> None:
    """One row of `tandem bench plot`'s three panels per hybrid stage that ran."""
    from bench.plot import PANELS, series

    ran = [s for s in stages if s.name.startswith("hybrid") and isinstance(s.result, dict)]
    figure = _figure(len(ran), len(PANELS))
    if figure is None or not ran:
        return
    axes = figure.subplots(len(ran), len(PANELS), squeeze=False)
    for row, stage in zip(axes, ran, strict=True):
        lines = {**stage.result.get("modes", {}), **stage.result.get("peers", {})}
        levels = sorted({int(level) for data in lines.values() for level in data["levels"]})
        for axis, (title, keys) in zip(row, PANELS, strict=True):
            for colour, (name, data) in enumerate(lines.items()):
                by_level = {"levels": list(data["levels"].values())}
                for key, style in keys:
                    x, y = series(by_level, key)
                    label = name if style == "-" else None
                    axis.plot(x, y, style, marker="o", color=f"C{colour}", label=label)
            axis.set_title(f"{stage.name}: {title}", fontsize=9)
            axis.set_xscale("log", base=2)
            axis.set_xticks(levels, [str(level) for level in levels])
            axis.set_xlabel("concurrency")
            axis.set_ylim(bottom=0)
            axis.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    figure.savefig(path, format="png", dpi=80)


def plot_verify(stages: list, path: Path) -> None:
    """Verify / plain step of the same rows against tokens, one line per row count."""
    ran = [s for s in stages if s.name.startswith("verify") and isinstance(s.result, dict)]
    figure = _figure(1, len(ran))
    if figure is None or not ran:
        return
    axes = figure.subplots(1, len(ran), squeeze=False)[0]
    for axis, stage in zip(axes, ran, strict=True):
        cells = stage.result["cells"]
        for colour, rows in enumerate(sorted({c["rows"] for c in cells})):
            mine = sorted((c for c in cells if c["rows"] == rows), key=lambda c: c["tokens"])
            axis.plot([c["tokens"] for c in mine], [c["vs_plain_step_same_rows"] for c in mine],
                      marker="o", color=f"C{colour}", label=f"{rows} rows")  # fmt: skip
        axis.set_title(f"{stage.name}: verify / plain step, same rows", fontsize=9)
        axis.set_xlabel("tokens per row")
        axis.set_xscale("log", base=2)
        tokens = sorted({c["tokens"] for c in cells})
        axis.set_xticks(tokens, [str(t) for t in tokens])
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.savefig(path, format="png", dpi=80)


def _figure(rows: int, cols: int):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure(figsize=(5 * max(cols, 1), 3.6 * max(rows, 1)), layout="constrained")
