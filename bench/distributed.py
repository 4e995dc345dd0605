"""`tandem bench distributed MODEL`: what serving one model across ranks costs, and
what speculation gives back there, measured side by side in one run.

Each row's server starts in turn (they would share the CPU), serves the same greedy
requests one at a time, and stops:

  tandem              one process, plain decoding (--no-pld, no draft)
  tandem xN           N ranks (as `mlx.launch` starts them), --distributed tensor, plain
  tandem xN +spec     the same with prompt lookup (and --draft-model, if given)
  mlx_lm              mlx_lm.server, one process
  mlx_lm xN           mlx_lm.server on N ranks the same way (its distributed mode
                      refuses draft models, so it has no speculative row)

Ranks run on this one machine over the ring backend on 127.0.0.1: they share its
cores and memory, so this measures the lockstep's overhead and exactness, not a
gain; across two Macs each rank has its own. Tandem's rows are also checked for
identical text (sharding must not change a greedy output).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.peer import PEER_MODEL_ID, peer_env, wait_until_answering
from bench.single_stream import free_port, start_process, stop_server

DATA = Path(__file__).parent / "data"


@dataclass
class Row:
    name: str
    command: str
    tokens: int
    seconds: float
    texts: list[str]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def load_requests(dataset: str, count: int) -> list[list[dict] | str]:
    """The first `count` entries of bench/data/DATASET.jsonl: chat messages, or a plain
    prompt (sent as a completion, so models without a chat template run it too)."""
    entries = [json.loads(line) for line in (DATA / f"{dataset}.jsonl").read_text().splitlines()]
    return [e.get("messages") or e["prompt"] for e in entries][:count]


def local_ranks(ranks: int, cmd: list[str]) -> list[str]:
    """`cmd` as `ranks` processes on this machine, wired as `mlx.launch --backend ring`
    wires them (MLX_RANK, and MLX_HOSTFILE naming one 127.0.0.1 port per rank), in one
    shell that runs rank 0 in its place. Not mlx.launch itself: its I/O loop (MLX
    0.32) polls the ranks' stdin pipes without blocking and keeps more than a core
    busy, which on this 2-core box would be measured as Tandem's cost."""
    hosts = [[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]
    hostfile = Path(tempfile.mkstemp(prefix="tandem-ring-", suffix=".json")[1])
    hostfile.write_text(json.dumps(hosts))
    line = shlex.join(cmd)
    script = "".join(
        f"MLX_RANK={rank} MLX_HOSTFILE={hostfile} {line} & " for rank in range(1, ranks)
    )
    return ["bash", "-c", f"{script}MLX_RANK=0 MLX_HOSTFILE={hostfile} exec {line}"]


@contextmanager
def server(cmd: list[str], port: int, peer: bool) -> Iterator[str]:
    log = Path(tempfile.gettempdir()) / f"tandem-bench-dist-{port}.log"
    proc = start_process(cmd, port, peer_env(), log, own_group=True)
    url = f"http://127.0.0.1:{port}"
    try:
        if peer:
            wait_until_answering(url, proc)
        yield url
    finally:
        stop_server(proc)


def run_requests(url: str, model: str, requests: list[list[dict] | str], max_tokens: int) -> Row:
    tokens, texts = 0, []
    started = time.perf_counter()
    for request in requests:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0}
        if isinstance(request, str):
            response = httpx.post(
                f"{url}/v1/completions", json={**body, "prompt": request}, timeout=1800
            )
        else:
            body["messages"] = request
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
        response.raise_for_status()
        reply = response.json()
        tokens += reply["usage"]["completion_tokens"]
        choice = reply["choices"][0]
        texts.append(choice["text"] if isinstance(request, str) else choice["message"]["content"])
    return Row("", "", tokens, time.perf_counter() - started, texts)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="tandem bench distributed", description=__doc__)
    parser.add_argument("model", help="an mlx-lm folder, .gguf or packaged name (tensor-shardable)")
    parser.add_argument("--draft-model", help="draft model for the +spec row (rank 0 only)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dataset", default="code-edit", help="bench/data/NAME.jsonl")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-peer", action="store_true", help="skip the mlx_lm.server rows")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)

    from engines.model.registry import model_folder
    from engines.platform.blas import describe_blas, find_fast_blas

    folder = model_folder(args.model)  # a GGUF or packaged name, imported once, up front
    requests = load_requests(args.dataset, args.requests)
    tandem = [
        str(Path(sys.executable).parent / "tandem"),
        "serve",
        folder,
        "--log-level",
        "warning",
    ]
    tandem += ["--served-model-name", "bench", "--host", "127.0.0.1"]
    spec = ["--draft-model", args.draft_model] if args.draft_model else []
    n = args.ranks
    configs = [
        ("tandem", [*tandem, "--no-pld"], False, False),
        (f"tandem x{n}", [*tandem, "--no-pld", "--distributed", "tensor"], True, False),
        (f"tandem x{n} +spec", [*tandem, *spec, "--distributed", "tensor"], True, False),
    ]
    if not args.no_peer:
        peer = [sys.executable, "-m", "mlx_lm", "server", "--model", folder, "--host", "127.0.0.1"]
        peer += ["--log-level", "WARNING"]
        configs += [("mlx_lm", peer, False, True), (f"mlx_lm x{n}", peer, True, True)]

    rows = []
    for name, cmd, distributed, is_peer in configs:
        port = free_port()
        full = [*cmd, "--port", str(port)]
        if distributed:
            full = local_ranks(n, full)
        with server(full, port, is_peer) as url:
            row = run_requests(
                url, PEER_MODEL_ID if is_peer else "bench", requests, args.max_tokens
            )
        row.name, row.command = name, " ".join(full)
        rows.append(row)
        print(
            f"{name}: {row.tokens} tokens in {row.seconds:.1f}s, {row.tok_s:.2f} tok/s", flush=True
        )
    fast = find_fast_blas()  # what `tandem serve` re-execs with, and the peers get
    blas = f"{Path(fast).name} (preloaded in every server)" if fast else describe_blas()
    report(rows, args, blas)


def report(rows: list[Row], args: argparse.Namespace, blas: str) -> None:
    base = rows[0]
    print(
        f"\nmodel {args.model}, {args.dataset} x{args.requests}, greedy, max_tokens "
        f"{args.max_tokens}, one request at a time; {platform.machine()}, BLAS {blas}; "
        f"{args.ranks} ranks on this one machine (ring over 127.0.0.1)\n"
    )
    print("| server | tok/s | vs tandem 1 process | same text as tandem 1 process |")
    print("|---|---|---|---|")
    for row in rows:
        same = "yes" if row.texts == base.texts else "no"
        if row.name.startswith("mlx_lm"):
            same = "n/a (other server)"
        print(f"| {row.name} | {row.tok_s:.2f} | {row.tok_s / base.tok_s:.2f}x | {same} |")
    if args.out:
        result = {"args": vars(args), "blas": blas, "rows": [asdict(r) for r in rows]}
        Path(args.out).write_text(json.dumps(result, indent=1))
