"""Recorded multi-turn agent sessions for `tandem bench agent`: the format, the copies
replayed side by side, and each turn's request as sent.

A session file (bench/data/agent/NAME.json) holds what one real client put on the wire,
turn by turn: `surface` ("messages" or "responses"), `method`, `path`, `query`, the
non-secret `headers` and the JSON `body`, exactly as captured. A later turn's history
holds the assistant's earlier answers as they were recorded (the client's tool calls
and tool results); only the answer to each turn is generated live when replayed.

    python -m bench.agent_sessions     # rebuild bench/data/agent/ from the captures

The captures are tests/data/agent_requests/ (recorded from the real CLIs by
tests/agent_clients/capture_server.py). Replaying changes only what a benchmark must
control, and says so in its report (`REPLAY_CHANGES`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SESSIONS_DIR = ROOT / "bench" / "data" / "agent"
CAPTURES = ROOT / "tests" / "data" / "agent_requests"
SURFACES = {"/v1/messages": "messages", "/v1/responses": "responses"}
# never stored, never replayed: secrets, and what the HTTP client sets itself
DROPPED_HEADERS = {
    "authorization",
    "x-api-key",
    "cookie",
    "openai-api-key",
    "connection",
    "accept-encoding",
    "content-length",
    "host",
}
# (session name, client as recorded, capture files in turn order)
RECORDED = (
    (
        "claude-code-2.1",
        "Claude Code 2.1.197 (claude -p)",
        ("claude-code-2.1-first", "claude-code-2.1-second"),
    ),
    ("codex-0.171", "Codex CLI 0.171.0 (codex exec)", ("codex-0.171-first", "codex-0.171-second")),
)
REPLAY_CHANGES = (
    "model -> the served model id; stream -> true; temperature -> 0 (greedy); "
    "max_tokens / max_output_tokens -> --max-tokens; a tag '[bench session ID]' prepended to "
    "the first user message (and to prompt_cache_key / session-id headers) so concurrent "
    "copies do not share one conversation"
)


@dataclass(frozen=True)
class Turn:
    surface: str  # "messages" | "responses"
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass(frozen=True)
class Session:
    name: str
    client: str
    turns: tuple[Turn, ...]


def load_session(path: Path) -> Session:
    data = json.loads(path.read_text())
    turns = tuple(
        Turn(t["surface"], t["path"], dict(t.get("headers") or {}), t["body"])
        for t in data["turns"]
    )
    if not turns:
        raise SystemExit(f"{path}: a session needs at least one turn")
    return Session(data["name"], data["client"], turns)


def find_sessions(names: list[str]) -> list[Session]:
    """Sessions by name (bench/data/agent/NAME.json) or path."""
    found = []
    for name in names:
        path = Path(name) if name.endswith(".json") else SESSIONS_DIR / f"{name}.json"
        if not path.exists():
            known = sorted(p.stem for p in SESSIONS_DIR.glob("*.json"))
            raise SystemExit(f"no session {name!r} (known: {', '.join(known)})")
        found.append(load_session(path))
    return found


# --- copies --------------------------------------------------------------------------


def tag_text(text: str, tag: str) -> str:
    return f"[bench session {tag}] {text}"


def tag_content(content: Any, tag: str) -> Any:
    """`content` (a string, or a list of text parts) with the tag before its first text."""
    if isinstance(content, str):
        return tag_text(content, tag)
    parts = copy.deepcopy(content)
    for part in parts:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            part["text"] = tag_text(part["text"], tag)
            return parts
    return [{"type": "text", "text": tag_text("", tag)}, *parts]


def first_user(items: list) -> dict | None:
    for item in items:
        if isinstance(item, dict) and item.get("role") == "user":
            return item
    return None


def tagged_body(body: dict, tag: str) -> dict:
    """The body with `tag` in its first user message (messages or Responses input)."""
    out = copy.deepcopy(body)
    items = out.get("messages") if "messages" in out else out.get("input")
    if isinstance(items, str):
        out["input"] = tag_text(items, tag)
    elif isinstance(items, list) and (user := first_user(items)) is not None:
        user["content"] = tag_content(user.get("content", ""), tag)
    if isinstance(out.get("prompt_cache_key"), str):
        out["prompt_cache_key"] = f"{out['prompt_cache_key']}-{tag}"
    return out


def tagged_headers(headers: dict[str, str], tag: str) -> dict[str, str]:
    ids = {"x-claude-code-session-id", "session-id", "thread-id", "x-client-request-id"}
    return {k: f"{v}-{tag}" if k.lower() in ids else v for k, v in headers.items()}


def session_copy(session: Session, tag: str) -> Session:
    """One concurrent copy: the same turns, with its own tag throughout."""
    turns = tuple(
        Turn(t.surface, t.path, tagged_headers(t.headers, tag), tagged_body(t.body, tag))
        for t in session.turns
    )
    return Session(f"{session.name}#{tag}", session.client, turns)


def replay_body(turn: Turn, model: str, max_tokens: int) -> dict:
    """What the benchmark sends for `turn` (see `REPLAY_CHANGES`)."""
    body = {**copy.deepcopy(turn.body), "model": model, "stream": True, "temperature": 0}
    limit = "max_tokens" if turn.surface == "messages" else "max_output_tokens"
    body[limit] = max_tokens
    return body


# --- building the files from the captures ---------------------------------------------


def capture_turn(path: Path) -> dict:
    data = json.loads(path.read_text())
    surface = SURFACES.get(data["path"])
    if surface is None:
        raise SystemExit(f"{path}: {data['path']} is not an agent surface")
    headers = {k: v for k, v in data["headers"].items() if k.lower() not in DROPPED_HEADERS}
    return {
        "surface": surface,
        "method": data["method"],
        "path": data["path"],
        "query": data.get("query") or {},
        "headers": headers,
        "body": data["body"],
    }


def build_sessions(out_dir: Path = SESSIONS_DIR) -> list[Path]:
    """Write one session file per recorded client from its captures, turn by turn."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, client, captures in RECORDED:
        files = [CAPTURES / f"{capture}.json" for capture in captures]
        session = {
            "name": name,
            "client": client,
            "recorded_from": [str(f.relative_to(ROOT)) for f in files],
            "note": "each turn's request as the client sent it; later turns carry the "
            "recorded assistant answers (tool calls) and tool results in their history",
            "turns": [capture_turn(f) for f in files],
        }
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(session, indent=1, ensure_ascii=False) + "\n")
        written.append(path)
    return written


if __name__ == "__main__":
    for written_path in build_sessions():
        print(written_path)
