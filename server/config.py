"""Server settings: one frozen dataclass built from the CLI and passed down."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.config import SchedulerConfig
from server.images import ImageLimits

# Tokens a reply may generate when the request names no limit (--default-max-tokens):
# above any one agent turn (Claude Code asks 32000 itself), cut to the context's room.
DEFAULT_MAX_TOKENS = 32768


@dataclass(frozen=True)
class ServerConfig:
    scheduler: SchedulerConfig
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    # The operator's cap on tokens one reply generates; None: only the context's room
    # (and the KV budget) bound what a client asks for.
    max_tokens: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # for requests that name no limit
    # Refuse max_tokens above the cap or the context's room (400) instead of cutting it.
    strict_max_tokens: bool = False
    stream_keepalive: float = 10.0  # seconds a stream may stay silent before a keep-alive
    demo: bool = False
    metrics: bool = True  # serve GET /metrics
    ui: bool = True  # serve the web page at / (and GET /ui/status)
    metrics_api_keys: tuple[str, ...] = ()  # keys that may read /metrics (besides API keys)
    allowed_origins: tuple[str, ...] = ()  # CORS; empty = off
    max_body_bytes: int = 4 << 20
    body_timeout: float = 60.0  # seconds for a request body to arrive once read (408)
    # Host names a keyless server answers (besides loopback names and IP addresses);
    # "*" = any. The CLI sets loopback-only for keyless servers.
    allowed_hosts: tuple[str, ...] = ("*",)
    rate_limit_per_minute: float = 0.0  # per API key (or client address); 0 = off
    shutdown_timeout: float = 30.0
    tool_call_parser: str = "auto"  # auto (from the chat template), none, or an mlx-lm parser
    reasoning_parser: str = "auto"  # auto (from the vocabulary), none, think, deepseek_r1
    strict_tool_calls: bool = False  # only tagged tool calls; untagged JSON calls stay text
    tool_call_grammar: str = "off"  # auto: tagged calls under tool_choice auto are enforced
    responses_store_bytes: int = 32 << 20  # bound on stored Responses (also 256 entries)
    image_limits: ImageLimits = ImageLimits()  # bytes, pixels, count, URL hosts
