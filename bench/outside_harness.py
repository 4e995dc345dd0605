"""Tandem against `mlx_lm.server`, measured by an outside harness (guidellm).

    python -m bench.outside_harness [--model smollm2-135m] [--concurrency 1,4]
                                    [--requests 20] [--max-seconds 600] [--rounds 1]

Our own load generator (`tandem bench serve --peer mlx_lm`) could share a blind spot
with the server it measures; this runs someone else's. Each server in turn, alone on
the machine, on 127.0.0.1, on the same model folder with the same fast BLAS preloaded:
`tandem serve MODEL` with its default settings (prompt lookup on, its disk prefix tier
writing to a temporary folder that is removed after), and `mlx_lm.server --model MODEL`.
guidellm loads each at every concurrency (`--profile concurrent`, its synthetic text
prompts of `--prompt-tokens` tokens asking for `--output-tokens`, streamed chat
completions, `ignore_eos`), bounded by `--requests` and `--max-seconds` per level. The
table gives guidellm's output tok/s, TTFT and ITL per server, and Tandem's ratio to
mlx_lm.server, all from this one run; with `--rounds 2` the second round runs the
servers in the other order. mlx_lm.server ignores `ignore_eos`: the table shows each
server's output tokens per request, so unequal work is visible.

guidellm is not a dependency of Tandem (it brings torch); install it in a venv of its
own and name it with `--guidellm` (default: `.bench-venv/bin/guidellm` beside this
repository, else `guidellm` on PATH):

    python -m venv .bench-venv && .bench-venv/bin/pip install guidellm==0.8.1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("tandem", "mlx_lm")
TANDEM_MODEL_ID = "bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.outside_harness", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="smollm2-135m", help="a bench model name or folder")
    parser.add_argument("--concurrency", default="1,4", help="users (streams) per level")
    parser.add_argument("--requests", type=int, default=20, help="requests per level")
    parser.add_argument("--max-seconds", type=float, default=600, help="time bound per level")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument(
        "--temperature",
        default="1.0",
        help="sent to both servers ('none': send none, each server's own default: "
        "Tandem's is OpenAI's 1.0, mlx_lm.server's 0.0)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="the second runs mlx_lm first")
    parser.add_argument("--servers", default=",".join(SERVERS), help="which of: tandem, mlx_lm")
    parser.add_argument("--tandem-flags", default="", help="extra `tandem serve` flags")
    parser.add_argument("--guidellm", help="the guidellm executable (see above)")
    parser.add_argument("--json", type=Path, help="write the rows and settings here")
    return parser.parse_args(argv)


def guidellm_executable(given: str | None) -> str:
    """`given`, the repository's `.bench-venv`, or PATH's; a message saying how to
    install it when there is none."""
    candidates = [given] if given else [str(ROOT / ".bench-venv" / "bin" / "guidellm")]
    candidates.append(shutil.which("guidellm") or "")
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit(
        "guidellm not found: python -m venv .bench-venv && "
        ".bench-venv/bin/pip install guidellm==0.8.1 (or give --guidellm PATH)"
    )


def temperature_of(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def guidellm_command(
    guidellm: str,
    url: str,
    model_id: str,
    tokenizer: str,
    args: argparse.Namespace,
    streams: int,
    output: Path,
) -> list[str]:
    """One level: `streams` concurrent users until `--requests` or `--max-seconds`."""
    backend: dict[str, Any] = {"kind": "openai_http", "target": url, "model": model_id}
    temperature = temperature_of(args.temperature)
    if temperature is not None:
        backend["extras"] = {"body": {"temperature": temperature}}
    data = {
        "kind": "synthetic_text",
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
    }
    return [
        guidellm,
        "run",
        "--backend", json.dumps(backend),
        "--profile", json.dumps({"kind": "concurrent", "streams": streams}),
        "--constraint", json.dumps({"kind": "max_requests", "count": args.requests}),
        "--constraint", json.dumps({"kind": "max_duration", "seconds": args.max_seconds}),
        "--data", json.dumps(data),
        "--tokenizer", json.dumps({"kind": "hf_auto", "model": tokenizer}),
        "--output", json.dumps({"kind": "json", "path": str(output)}),
        "--disable-console-interactive",
    ]  # fmt: skip


def level_row(report: dict[str, Any]) -> dict[str, Any]:
    """What the table shows of one guidellm benchmark (its JSON report's first)."""
    benchmark = report["benchmarks"][0]
    metrics = benchmark["metrics"]

    def stat(name: str, key: str) -> float | None:
        values = metrics.get(name, {}).get("successful", {})
        return values.get(key) if values.get("count") else None

    totals = metrics.get("request_totals", {})
    return {
        "output_tok_s": stat("output_tokens_per_second", "mean"),
        "ttft_ms_p50": stat("time_to_first_token_ms", "median"),
        "ttft_ms_mean": stat("time_to_first_token_ms", "mean"),
        "itl_ms_p50": stat("inter_token_latency_ms", "median"),
        "itl_ms_mean": stat("inter_token_latency_ms", "mean"),
        "output_tokens_per_request": stat("output_token_count", "mean"),
        "requests": totals.get("successful", 0),
        "errored": totals.get("errored", 0),
        "seconds": benchmark.get("duration"),
    }


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if not ours or not theirs else ours / theirs


def table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per server and level, then Tandem / mlx_lm.server per level and round
    (> 1: Tandem more tok/s; < 1: Tandem's TTFT or ITL shorter)."""

    def number(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        "| round | users | server | output tok/s | TTFT p50 (mean) ms | ITL p50 (mean) ms "
        "| tokens/request | requests |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        errors = f" ({row['errored']} errors)" if row["errored"] else ""
        lines.append(
            f"| {row['round']} | {row['users']} | {row['server']} | "
            f"{number(row['output_tok_s'], 2)} | {number(row['ttft_ms_p50'], 0)} "
            f"({number(row['ttft_ms_mean'], 0)}) | {number(row['itl_ms_p50'])} "
            f"({number(row['itl_ms_mean'])}) | {number(row['output_tokens_per_request'])} | "
            f"{row['requests']}{errors} |"
        )
    lines += ["", "| round | users | Tandem / mlx_lm.server: output tok/s | TTFT p50 | ITL p50 |"]
    lines.append("|---|---|---|---|---|")
    for (round_, users), pair in paired(rows).items():
        ours, theirs = pair.get("tandem"), pair.get("mlx_lm")
        if ours is None or theirs is None:
            continue
        cells = [
            ratio(ours[key], theirs[key]) for key in ("output_tok_s", "ttft_ms_p50", "itl_ms_p50")
        ]
        lines.append(
            f"| {round_} | {users} | " + " | ".join(f"{number(c, 2)}x" for c in cells) + " |"
        )
    return lines


def paired(rows: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, dict[str, Any]]]:
    pairs: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for row in rows:
        pairs.setdefault((row["round"], row["users"]), {})[row["server"]] = row
    return pairs


def median_ratios(rows: list[dict[str, Any]]) -> dict[int, float | None]:
    """Per level, the median over rounds of Tandem's output tok/s over mlx_lm.server's."""
    by_users: dict[int, list[float]] = {}
    for (_, users), pair in paired(rows).items():
        value = ratio(*(pair.get(s, {}).get("output_tok_s") for s in SERVERS))
        if value is not None:
            by_users.setdefault(users, []).append(value)
    return {users: statistics.median(values) for users, values in sorted(by_users.items())}


# --- the servers ------------------------------------------------------------------------


@contextmanager
def running_tandem(model: str, flags: list[str], scratch: Path) -> Iterator[str]:
    """`tandem serve MODEL` on a free port with its defaults (its disk prefix tier
    writing under `scratch`), healthy (its model loaded); stopped by its pid after."""
    from bench.peer import peer_env
    from bench.single_stream import free_port, start_process, stop_server

    port = free_port()
    tandem = str(Path(sys.executable).parent / "tandem")
    cmd = [tandem, "serve", model, "--port", str(port), "--served-model-name", TANDEM_MODEL_ID]
    # a disk tier of its own per start: a later round must not find an earlier round's
    # prompts on disk (guidellm sends the same synthetic prompts each round)
    env = {**peer_env(), "TANDEM_PREFIX_CACHE_DIR": str(scratch / f"prefix-{port}")}
    log = scratch / f"tandem-{port}.log"
    proc = start_process([*cmd, "--log-level", "warning", *flags], port, env, log)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


@contextmanager
def running_server(name: str, model: str, args: argparse.Namespace, scratch: Path):
    if name == "tandem":
        with running_tandem(model, args.tandem_flags.split(), scratch) as url:
            yield url, TANDEM_MODEL_ID
        return
    from bench.peer import PEER_MODEL_ID, PeerConfig, running_peer

    with running_peer(model, PeerConfig("mlx_lm")) as url:
        yield url, PEER_MODEL_ID


def measure(
    guidellm: str,
    url: str,
    model_id: str,
    model: str,
    args: argparse.Namespace,
    scratch: Path,
    label: str,
) -> list[dict[str, Any]]:
    """Every level against one running server."""
    rows = []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("LD_PRELOAD", None)  # the client computes nothing with MLX
    for users in [int(c) for c in args.concurrency.split(",") if c]:
        output = scratch / f"{label}-c{users}.json"
        command = guidellm_command(guidellm, url, model_id, model, args, users, output)
        log = scratch / f"{label}-c{users}.log"
        with log.open("w") as out:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
        if code != 0 or not output.exists():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise SystemExit(f"guidellm failed against {label} at {users} users:\n{tail}")
        row = {"users": users, **level_row(json.loads(output.read_text()))}
        print(
            f"  {label} c={users}: {row['output_tok_s']:.2f} tok/s, TTFT p50 "
            f"{row['ttft_ms_p50']:.0f} ms, ITL p50 {row['itl_ms_p50']:.1f} ms, "
            f"{row['requests']} requests",
            flush=True,
        )
        rows.append(row)
    return rows


def describe(model: str, args: argparse.Namespace, guidellm: str) -> dict[str, str]:
    from engines.platform.blas import find_fast_blas

    version = subprocess.run([guidellm, "--version"], capture_output=True, text=True).stdout
    return {
        "model": f"{args.model} -> {model}",
        "blas": f"{find_fast_blas() or 'MLX bundled'} preloaded in both servers",
        "harness": version.strip() or guidellm,
        "settings": (
            f"guidellm synthetic_text {args.prompt_tokens} prompt tokens, "
            f"{args.output_tokens} output tokens, ignore_eos, streamed chat completions, "
            f"temperature {args.temperature}, concurrent users {args.concurrency}, "
            f"at most {args.requests} requests / {args.max_seconds:.0f} s per level, "
            f"{args.rounds} round(s); tandem serve defaults {args.tandem_flags}".rstrip()
        ),
        "machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start",
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    guidellm = guidellm_executable(args.guidellm)
    from bench.models import resolve_model

    model = resolve_model(args.model)
    setup = describe(model, args, guidellm)
    for key, value in setup.items():
        print(f"{key:9} {value}")
    servers = [s for s in args.servers.split(",") if s in SERVERS]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-outside-") as folder:
        scratch = Path(folder)
        for round_ in range(1, args.rounds + 1):
            for name in servers if round_ % 2 else servers[::-1]:
                started = time.monotonic()
                with running_server(name, model, args, scratch) as (url, model_id):
                    print(f"round {round_}: {name} at {url}", flush=True)
                    label = f"{name}-r{round_}"
                    levels = measure(guidellm, url, model_id, model, args, scratch, label)
                rows += [{"round": round_, "server": name, **level} for level in levels]
                print(f"  ({time.monotonic() - started:.0f} s with start and stop)")
    print()
    for line in table(rows):
        print(line)
    result = {"setup": setup, "rows": rows, "median_ratio_by_users": median_ratios(rows)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
