"""The peer in the harness: `mlx_lm.server` on the same model, measured the same way.

`tandem bench hybrid` (by default) and `tandem bench serve --peer mlx_lm` start
`python -m mlx_lm server --model PATH` on 127.0.0.1 with the fast BLAS Tandem would
preload, wait until it answers a completion, load it with the same prompts and
settings through the same client, and put its rows next to Tandem's. With a draft
model both peer configurations run: `mlx_lm` (plain: it batches concurrent requests)
and `mlx_lm+draft` (`--draft-model`: speculative, one request at a time). At each
concurrency Tandem's row is compared with the better of the peer rows (higher output
tok/s).

mlx_lm.server 0.32 quirks this module accounts for:
- requests name the model `default_model`; its `GET /v1/models` lists the Hugging
  Face cache (and fails when there is none), so the id is never read from there;
- it ignores `ignore_eos`: a comparison is of equal work only when both produced the
  same number of tokens (from `usage`), and each comparison says whether they did;
- while it prefills it sends `: keepalive` SSE comments (the client skips them);
- a request carrying `seed` (the harness sends one when temperature > 0) is served
  alone, unbatched.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from bench.single_stream import free_port, start_process, stop_server

PEERS = ("mlx_lm", "none")
PEER_MODEL_ID = "default_model"


def add_peer_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    """`--peer` and its option, shared by `tandem bench serve` and `hybrid`."""
    parser.add_argument(
        "--peer",
        choices=PEERS,
        default=default,
        help="also start this server on the same model and measure it the same way",
    )
    parser.add_argument(
        "--peer-num-draft-tokens",
        type=int,
        help="the drafting peer's --num-draft-tokens (default: mlx_lm's own, 3)",
    )


@dataclass(frozen=True)
class PeerConfig:
    """One way of running the peer: a row name and its extra `mlx_lm server` flags."""

    name: str
    flags: tuple[str, ...] = ()


def peer_configs(draft: str | None, num_draft_tokens: int | None = None) -> list[PeerConfig]:
    """Plain mlx_lm.server, and with a draft model also the speculative one (mlx_lm.server
    cannot load a drafter fed the target's hidden states: DFlash, EAGLE-3, assistant)."""
    from engines.drafting.feature_drafters import drafter_kind

    configs = [PeerConfig("mlx_lm")]
    if draft and drafter_kind(draft) == "model":
        k = ("--num-draft-tokens", str(num_draft_tokens)) if num_draft_tokens else ()
        configs.append(PeerConfig("mlx_lm+draft", ("--draft-model", draft, *k)))
    return configs


def shown_command(model: str, config: PeerConfig) -> list[str]:
    """The peer's command as the report shows it (without host, port and interpreter)."""
    return ["mlx_lm.server", "--model", model, *config.flags]


def peer_command(model: str, port: int, config: PeerConfig) -> list[str]:
    server = [sys.executable, "-m", "mlx_lm", "server", "--model", model]
    listen = ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
    return [*server, *listen, *config.flags]


def peer_env() -> dict[str, str]:
    """This environment with the fast BLAS that `tandem serve` would preload on Linux
    CPU (`engines.platform.blas.find_fast_blas`) added to LD_PRELOAD, so both compute alike;
    unchanged where Tandem would not preload (TANDEM_NO_BLAS_PRELOAD, or a GPU)."""
    from engines.platform.blas import FAST_BLAS_PATTERN, computes_on_cpu, find_fast_blas

    env = dict(os.environ)
    preload = env.get("LD_PRELOAD", "")
    preloads = sys.platform.startswith("linux") and not env.get("TANDEM_NO_BLAS_PRELOAD")
    preloads = preloads and computes_on_cpu()
    fast = find_fast_blas() if preloads else None
    if fast and not FAST_BLAS_PATTERN.search(preload):
        env["LD_PRELOAD"] = ":".join(p for p in (fast, preload) if p)
    return env


@contextmanager
def running_peer(model: str, config: PeerConfig) -> Iterator[str]:
    """A started peer's base URL, answering completions; stopped when the block ends."""
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"tandem-peer-{port}.log"
    proc = start_process(peer_command(model, port, config), port, peer_env(), log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(url, proc)
        yield url
    finally:
        stop_server(proc)


def wait_until_answering(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    """`/health` is up before the model is loaded; a one-token completion is not."""
    body = {"model": PEER_MODEL_ID, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            left = max(1.0, deadline - time.monotonic())
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=left)
            if response.status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"the mlx_lm.server peer at {url} never answered a completion")


def measure_peers(
    model: str,
    draft: str | None,
    measure: Callable[[str], dict[str, Any]],
    num_draft_tokens: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Each peer configuration started in turn, `measure(base_url)`d, and stopped.
    Only one server runs at a time: they would share the CPU."""
    results = {}
    for config in peer_configs(draft, num_draft_tokens):
        with running_peer(model, config) as url:
            command = shown_command(model, config)
            results[config.name] = {"peer": {"command": command}, **measure(url)}
    return results


def run_with_peers(settings: Any, run: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """`tandem bench serve --peer`: `run(settings)` against `--base-url`, then against
    each peer configuration started afresh (one server at a time), and the server's
    rows compared with the best peer row at each level. `settings` is `bench.serve`'s
    Settings; the peer's model is resolved before any load."""
    model = settings.peer_model
    result = run(settings)
    as_peer = replace(settings, model=PEER_MODEL_ID, peer="none", output=None, plot=None)

    def measure(url: str) -> dict[str, Any]:
        return run(replace(as_peer, base_url=url))

    peers = measure_peers(model, settings.peer_draft_model, measure, settings.peer_num_draft_tokens)
    levels = {name: by_concurrency(peer["levels"]) for name, peer in peers.items()}
    result["peers"] = peers
    result["peer_comparison"] = compare(by_concurrency(result["levels"]), levels)
    return result


# --- comparison ---------------------------------------------------------------------


def by_concurrency(levels: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {level["concurrency"]: level for level in levels}


def compare(
    tandem: dict[int, dict[str, Any]], peers: dict[str, dict[int, dict[str, Any]]]
) -> dict[int, dict[str, Any]]:
    """At each concurrency, Tandem's row against the best peer row (highest output
    tok/s): throughput ratio (> 1: Tandem is faster), TTFT p50 ratio (< 1: Tandem
    answers sooner), and whether both produced the same number of tokens."""
    comparison = {}
    for level, row in sorted(tandem.items()):
        rows = {name: by_level[level] for name, by_level in peers.items() if level in by_level}
        if not rows:
            continue
        best = max(rows, key=lambda name: rows[name]["output_throughput"])
        peer = rows[best]
        comparison[level] = {
            "best_peer": best,
            "output_throughput_ratio": ratio(row["output_throughput"], peer["output_throughput"]),
            "p50_ttft_ratio": ratio(row.get("p50_ttft_ms"), peer.get("p50_ttft_ms")),
            "tandem_output_tokens": row["total_output_tokens"],
            "peer_output_tokens": peer["total_output_tokens"],
            "same_output_tokens": row["total_output_tokens"] == peer["total_output_tokens"],
        }
    return comparison


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if not ours or not theirs else ours / theirs


def comparison_lines(name: str, comparison: dict[int, dict[str, Any]], peers: list[str]) -> list:
    """One line per concurrency: `NAME / best(PEERS) at c=C: 1.23x tok/s ...`."""
    lines = []
    for level, cmp in comparison.items():
        ttft = cmp["p50_ttft_ratio"]
        line = (
            f"{name} / best({', '.join(peers)}) at c={level}: "
            f"{fmt(cmp['output_throughput_ratio'])} tok/s, {fmt(ttft)} TTFT p50 "
            f"(best peer: {cmp['best_peer']})"
        )
        if not cmp["same_output_tokens"]:
            line += (
                f"; UNEQUAL WORK: {cmp['tandem_output_tokens']} vs "
                f"{cmp['peer_output_tokens']} output tokens"
            )
        lines.append(line)
    return lines


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def peer_report(result: dict[str, Any], label: str, table: Callable[[dict], str]) -> str:
    """Each peer's `table` under the command that started it, then the ratios."""
    lines = []
    for name, peer in result["peers"].items():
        lines += [f"\npeer {name}: {' '.join(peer['peer']['command'])}", table(peer)]
    lines += comparison_lines(label, result["peer_comparison"], list(result["peers"]))
    return "\n".join(lines)
