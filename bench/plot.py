"""Plot `tandem bench serve` results: `tandem bench plot a.json b.json -o cmp.png`.

Three panels against concurrency: output throughput, TTFT p50/p99 and ITL p50/p99.
Several result files overlay, one colour each, labelled by file name, so two servers
(or two settings) measured with the same harness compare at a glance; the peers of a
`--peer` run get their own colours.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PANELS = (
    ("output throughput (tok/s)", (("output_throughput", "-"),)),
    ("TTFT (ms), p50 solid, p99 dashed", (("p50_ttft_ms", "-"), ("p99_ttft_ms", "--"))),
    ("ITL (ms), p50 solid, p99 dashed", (("p50_itl_ms", "-"), ("p99_itl_ms", "--"))),
)


def series(result: dict[str, Any], key: str) -> tuple[list[int], list[float]]:
    """(concurrency, value) per level; a missing value is NaN, a gap in the line."""
    levels = sorted(result["levels"], key=lambda level: level["concurrency"])
    values = [level.get(key) for level in levels]
    return (
        [level["concurrency"] for level in levels],
        [math.nan if value is None else float(value) for value in values],
    )


def with_peers(label: str, result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A result and, when it was run with `--peer`, each peer's result as its own line."""
    peers = result.get("peers") or {}
    return [(label, result), *((f"{label}: {name}", peer) for name, peer in peers.items())]


def plot_results(results: Sequence[tuple[str, dict[str, Any]]], path: Path) -> None:
    """Write a PNG. Uses `Figure` directly (no pyplot), so no GUI backend or global
    figure state is involved."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise SystemExit("plotting needs matplotlib: pip install matplotlib") from None
    figure = Figure(figsize=(15, 4.5), layout="constrained")
    axes = figure.subplots(1, len(PANELS))
    levels = sorted({level["concurrency"] for _, result in results for level in result["levels"]})
    for axis, (title, keys) in zip(axes, PANELS, strict=True):
        for colour, (label, result) in enumerate(results):
            for key, style in keys:
                x, y = series(result, key)
                name = label if style == "-" else None
                axis.plot(x, y, style, marker="o", color=f"C{colour}", label=name)
        axis.set_title(title)
        axis.set_xlabel("concurrency")
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(level) for level in levels])
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    axes[0].legend()
    figure.suptitle(describe(results))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)


def describe(results: Sequence[tuple[str, dict[str, Any]]]) -> str:
    first = results[0][1]
    blas = (first.get("server") or {}).get("blas") or {}
    parts = [f"dataset {first.get('dataset')}", f"endpoint {first.get('endpoint')}"]
    parts.append(f"max_tokens {first.get('settings', {}).get('max_tokens')}")
    if len(results) == 1:
        parts.insert(0, str(first.get("model")))
        parts.append(f"server BLAS {blas.get('blas', 'unknown')}")
    return ", ".join(parts)


def load_result(path: Path) -> dict[str, Any]:
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"cannot read {path}: {exc}") from exc
    if not isinstance(result, dict) or "levels" not in result:
        raise SystemExit(f"{path} is not a `tandem bench serve` result (no 'levels')")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="tandem bench plot", description="Overlay `tandem bench serve` results."
    )
    parser.add_argument("results", nargs="+", type=Path, help="result JSON files")
    parser.add_argument("-o", "--output", type=Path, required=True, help="PNG to write")
    args = parser.parse_args(argv)
    results = [line for path in args.results for line in with_peers(path.stem, load_result(path))]
    plot_results(results, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
