"""Tools a hosted API runs on its own servers (web search, code execution, ...).

Clients such as Codex CLI and Claude Code list them beside their own tools. Tandem
cannot run them, so they are not offered to the model, and the request is served
with the rest, as a hosted model without that feature would; each one left out is
logged and counted by kind. The kind is a bounded label: versioned names lose their
date (`web_search_20250305` -> `web_search`) and unknown names count as "other".
"""

from __future__ import annotations

import logging
import re

KNOWN_KINDS = (
    "web_search",
    "web_search_preview",
    "web_fetch",
    "file_search",
    "code_interpreter",
    "code_execution",
    "computer_use_preview",
    "computer",
    "image_generation",
    "mcp",
    "bash",
    "text_editor",
    "memory",
    "tool_search_tool_regex",
    "tool_search_tool_bm25",
)
_VERSION = re.compile(r"_\d{8}$")

log = logging.getLogger("tandem.server")


def server_tool_kind(tool_type: str) -> str:
    """A bounded name for a server tool's type, for logs and metrics labels."""
    kind = _VERSION.sub("", tool_type)
    return kind if kind in KNOWN_KINDS else "other"


def note_skipped_tools(metrics, surface: str, kinds: list[str]) -> None:
    """Log and count the server tools a request listed that the model was not offered."""
    if not kinds:
        return
    log.info("%s: not offering server tools the client listed: %s", surface, ", ".join(kinds))
    for kind in kinds:
        metrics.count_skipped_tool(surface, kind)
