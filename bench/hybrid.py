"""Hybrid vs batch-only vs speculative-only, side by side in one run, plus the cost
of a mode switch.

    tandem bench hybrid MODEL [--draft-model D] [--concurrency 1,2,4,8] [--max-tokens 64]
        [--peer mlx_lm|none] [--rounds 3]

Starts `tandem serve` once per mode on 127.0.0.1 -- hybrid (the default server:
one request speculates alone, two or more speculate inside the batch), batch-only
(plain continuous batching: --batch-threshold 1, drafting off), speculative-only (a
threshold no load reaches: requests beyond the first wait) and, with `--modes`,
hybrid-wait (--spec-wait-budget: newcomers may wait that long for a speculative run
when it measurably outruns batching) -- and load-tests each with `tandem bench serve`.
All servers run at once and are loaded one at a time, level by level; with `--rounds
N` every server is measured N times, interleaved (reverse order on odd rounds), and
the median round is reported with every round's tok/s, so a shared machine's drift
weighs on all servers alike. Then, against the hybrid server, one long stream runs
alone (speculative) and a second request arrives mid-stream: it reports the
newcomer's TTFT and the first stream's largest inter-token gap around the switch vs
its median gap.

With `--peer mlx_lm` (the default; `--peer none` skips it) the same levels also run
against `mlx_lm.server` on the same model (and, given a draft, `mlx_lm.server
--draft-model`), and both hybrid rows are compared with the better peer row at each
concurrency (`bench/peer.py`). Table, JSON and PNG hold every row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from bench.models import resolve_model
from bench.peer import (
    PEER_MODEL_ID,
    add_peer_arguments,
    compare,
    comparison_lines,
    peer_configs,
    running_peer,
    shown_command,
)
from bench.serve import main as bench_serve
from bench.single_stream import free_port, start_server, stop_server

MODES = {
    "hybrid": ["--batch-threshold", "2"],
    "hybrid-wait": ["--batch-threshold", "2", "--spec-wait-budget", "WAIT"],
    "batch-only": ["--batch-threshold", "1", "--no-pld", "--num-draft-tokens", "0"],
    "hybrid-nodraft": ["--batch-threshold", "2", "--no-pld", "--num-draft-tokens", "0"],
    "hybrid-nosuffix": ["--batch-threshold", "2", "--suffix-tokens-per-key", "0"],
    # the model drafter alone: no prompt lookup, no suffix decoding
    "hybrid-nolookup": ["--batch-threshold", "2", "--no-pld", "--suffix-tokens-per-key", "0"],
    "spec-only": ["--batch-threshold", "100000", "--max-num-seqs", "1"],
}
SWITCH_PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"


def start_mode(model: str, draft: str | None, extra: list[str], port: int) -> subprocess.Popen:
    flags = ["--max-tokens", "4096", *extra, *(["--draft-model", draft] if draft else [])]
    return start_server(model, port, flags)


def stream_times(url: str, max_tokens: int, stamps: list[float], started: list[float]) -> None:
    payload = {
        "model": "bench",
        "prompt": SWITCH_PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started.append(time.perf_counter())
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=600) as response:
        if response.status_code != 200:
            response.read()
            raise SystemExit(f"switch probe refused ({response.status_code}): {response.text}")
        for line in response.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                stamps.append(time.perf_counter())


def switch_probe(url: str, long_tokens: int, join_after: int, short_tokens: int) -> dict:
    """A stream alone, then a second request joins: what does the switch cost?"""
    first: list[float] = []
    first_started: list[float] = []
    thread = threading.Thread(target=stream_times, args=(url, long_tokens, first, first_started))
    thread.start()
    # Join once the first stream is well under way (chunks, not tokens: speculative
    # chunks carry several tokens), or give up waiting if it already ended.
    while len(first) < join_after and thread.is_alive():
        time.sleep(0.001)
    second: list[float] = []
    second_started: list[float] = []
    stream_times(url, short_tokens, second, second_started)
    thread.join()
    gaps = [b - a for a, b in zip(first, first[1:], strict=False)]
    joined_at = second_started[0]
    around = [
        b - a
        for a, b in zip(first, first[1:], strict=False)
        if a >= joined_at - 1.0 and b <= second[-1] + 1.0
    ]
    median = statistics.median(gaps)
    worst = max(around or gaps)
    return {
        "second_request_ttft_ms": 1000 * (second[0] - joined_at),
        "first_stream_median_gap_ms": 1000 * median,
        "first_stream_max_gap_around_switch_ms": 1000 * worst,
        "max_gap_over_median": worst / median,
    }


def mode_switches(url: str) -> dict:
    stats = httpx.get(f"{url}/v1/stats", timeout=10).json()
    return stats.get("mode_switches", {})


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    model = resolve_model(args.model)
    draft = resolve_model(args.draft_model) if args.draft_model else None
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict = {
        "model": model,
        "draft": draft,
        "blas": "unknown",
        "rounds": args.rounds,
        "modes": {},
    }
    modes = args.modes.split(",")
    with ExitStack() as servers:
        urls = {}
        for name in modes:
            extra = [str(args.spec_wait_budget) if f == "WAIT" else f for f in MODES[name]]
            urls[name] = servers.enter_context(running_mode(model, draft, extra))
        peers = peer_configs(draft, args.peer_num_draft_tokens) if args.peer != "none" else []
        for config in peers:
            urls[config.name] = servers.enter_context(running_peer(model, config))
        measured = measure_interleaved(urls, {c.name for c in peers}, levels, args)
        for name in modes:
            results["blas"] = measured[name]["blas"].get("blas", "unknown")
            results["modes"][name] = {**measured[name], "switches": mode_switches(urls[name])}
        if "hybrid" in urls:
            results["switch"] = switch_probe(urls["hybrid"], args.switch_tokens, 10, 24)
    if peers:
        add_peers(results, peers, measured, model)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2, default=str))
    print(report(results, levels))
    plot(results, args)
    return results


@contextmanager
def running_mode(model: str, draft: str | None, extra: list[str]) -> Iterator[str]:
    port = free_port()
    proc = start_mode(model, draft, extra, port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


def measure_interleaved(
    urls: dict[str, str], peers: set[str], levels: list[int], args: argparse.Namespace
) -> dict[str, dict]:
    """Every server started at once (idle ones cost nothing), then, round by round and
    level by level, each loaded in turn -- in reverse order on odd rounds -- so a
    machine that slows down or speeds up over minutes weighs on every server alike.
    Per server and level: the round with the median output tok/s as the row, and every
    round's tok/s beside it."""
    runs: dict[str, dict[int, list[dict]]] = {name: {lv: [] for lv in levels} for name in urls}
    blas: dict[str, dict] = {}
    for round_index in range(args.rounds):
        order = list(urls) if round_index % 2 == 0 else list(reversed(urls))
        for level in levels:
            for name in order:
                model = PEER_MODEL_ID if name in peers else None
                out = measure(urls[name], [level], args, model=model)
                runs[name][level].append(out["levels"][level])
                blas[name] = out["blas"]
    return {
        name: {
            "levels": {lv: _median_row(rows) for lv, rows in by_level.items()},
            "rounds_output_throughput": {
                lv: [row["output_throughput"] for row in rows] for lv, rows in by_level.items()
            },
            "blas": blas[name],
        }
        for name, by_level in runs.items()
    }


def _median_row(rows: list[dict]) -> dict:
    ranked = sorted(rows, key=lambda row: row["output_throughput"])
    return ranked[(len(ranked) - 1) // 2]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tandem bench hybrid", description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--draft-model")
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--prompts-per-level",
        type=int,
        default=2,
        help="requests per level = this x concurrency (at least 4)",
    )
    parser.add_argument(
        "--spec-wait-budget",
        type=float,
        default=2.0,
        help="seconds, for the hybrid-wait server",
    )
    parser.add_argument("--dataset", default="mixed")
    parser.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="chat: the dataset's messages through the model's chat template",
    )
    parser.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="let requests end at EOS (real chat models) instead of --ignore-eos; the "
        "peer comparison says whether both servers produced the same tokens",
    )
    parser.add_argument(
        "--switch-tokens",
        type=int,
        default=240,
        help="length of the switch probe's long stream (keep it within the model's context)",
    )
    parser.add_argument(
        "--modes",
        default="hybrid,batch-only,spec-only",
        help=f"comma-separated servers to run, of {','.join(MODES)}",
    )
    parser.add_argument("--output", type=Path, default=Path("bench/results/hybrid.json"))
    parser.add_argument("--plot", type=Path, help="PNG (default: the --output path, .png)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every server at every level this many times, interleaved; "
        "report the median round",
    )
    add_peer_arguments(parser, default="mlx_lm")
    return parser.parse_args(argv)


def measure(
    url: str, levels: list[int], args: argparse.Namespace, model: str | None = None
) -> dict:
    """`tandem bench serve` against `url`, one level at a time: {"levels", "blas"}."""
    by_level, blas = {}, {}
    for level in levels:
        out = bench_serve(
            [
                "--base-url",
                url,
                *(["--model", model] if model else []),
                "--concurrency",
                str(level),
                "--endpoint",
                args.endpoint,
                "--num-prompts",
                str(max(4, args.prompts_per_level * level)),
                "--max-tokens",
                str(args.max_tokens),
                "--dataset",
                args.dataset,
                *([] if args.stop_at_eos else ["--ignore-eos"]),
                "--warmup",
                "1",
            ]
        )
        by_level[level] = out["levels"][0]
        blas = out["server"]["blas"]
    return {"levels": by_level, "blas": blas}


def add_peers(results: dict, peers: list, measured: dict[str, dict], model: str) -> None:
    """The peer rows beside the modes; the hybrid rows compared with the better peer row
    at each level."""
    results["peers"] = {
        config.name: {
            "peer": {"command": shown_command(model, config)},
            **measured[config.name],
        }
        for config in peers
    }
    peer_levels = {name: peer["levels"] for name, peer in results["peers"].items()}
    results["peer_comparison"] = {
        name: compare(results["modes"][name]["levels"], peer_levels)
        for name in ("hybrid", "hybrid-wait")
        if name in results["modes"]
    }


def plot(results: dict, args: argparse.Namespace) -> None:
    """Every mode and peer as one line of `tandem bench plot`'s panels. Without
    matplotlib the default PNG is skipped (an explicit `--plot` fails)."""
    from bench.plot import plot_results

    rows = {**results["modes"], **results.get("peers", {})}
    shared = {
        "dataset": args.dataset,
        "endpoint": args.endpoint,
        "settings": {"max_tokens": args.max_tokens},
    }
    lines = [
        (name, {**shared, "levels": list(data["levels"].values())}) for name, data in rows.items()
    ]
    path = args.plot or args.output.with_suffix(".png")
    try:
        plot_results(lines, path)
    except SystemExit as missing:
        if args.plot:
            raise
        print(f"no plot: {missing}")
        return
    print(f"plot: {path}")


def report(results: dict, levels: list[int]) -> str:
    lines = [
        f"model {results['model']}  draft {results['draft']}  BLAS {results['blas']}",
        f"{'mode':12} {'conc':>4} {'out tok/s':>10} {'p50 TTFT ms':>12} "
        f"{'p50 ITL ms':>11} {'p99 ITL ms':>11}",
    ]
    for name, data in {**results["modes"], **results.get("peers", {})}.items():
        for level in levels:
            row = data["levels"][level]
            lines.append(
                f"{name:12} {level:>4} {row['output_throughput']:>10.1f} "
                f"{row['median_ttft_ms'] or 0:>12.1f} {row['p50_itl_ms'] or 0:>11.1f} "
                f"{row['p99_itl_ms'] or 0:>11.1f}"
            )
    baselines = [m for m in ("batch-only", "spec-only") if m in results["modes"]]
    best = {
        level: max(
            (results["modes"][m]["levels"][level]["output_throughput"] for m in baselines),
            default=0.0,
        )
        for level in levels
    }
    for name in ("hybrid", "hybrid-wait"):
        if name not in results["modes"] or not baselines:
            continue
        for level in levels:
            rate = results["modes"][name]["levels"][level]["output_throughput"]
            lines.append(
                f"{name} / best(batch-only, spec-only) at c={level}: {rate / best[level]:.2f}"
            )
    if results.get("rounds", 1) > 1:
        for name, data in {**results["modes"], **results.get("peers", {})}.items():
            for level in levels:
                rates = ", ".join(f"{r:.1f}" for r in data["rounds_output_throughput"][level])
                lines.append(f"{name} c={level}: tok/s by round {rates}")
    for name, data in results["modes"].items():
        for level in levels:
            spec = data["levels"][level].get("speculative") or {}
            if spec.get("batched_steps"):
                lines.append(
                    f"{name} c={level}: {spec['batched_steps']:.0f} batched steps, "
                    f"{100 * spec['batched_step_model_share']:.0f}% of their time in the model, "
                    f"{spec['drafted_per_row_per_batched_step'] or 0:.2f} tokens drafted per row"
                )
    for name, peer in results.get("peers", {}).items():
        blas = peer["blas"]
        lines.append(f"peer {name}: {' '.join(peer['peer']['command'])}")
        lines.append(f"  BLAS {blas.get('blas', 'unknown')} ({blas.get('library')})")
    peers = list(results.get("peers", {}))
    for name, comparison in results.get("peer_comparison", {}).items():
        lines.extend(comparison_lines(name, comparison, peers))
    switch = results.get("switch", {})
    if switch:
        lines.append(
            "switch: second request TTFT {second_request_ttft_ms:.1f} ms; first stream max gap "
            "{first_stream_max_gap_around_switch_ms:.1f} ms vs median "
            "{first_stream_median_gap_ms:.1f} ms ({max_gap_over_median:.2f}x)".format(**switch)
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
