"""`tandem bench agent`: recorded coding-agent sessions replayed against Tandem and
`mlx_lm.server` on the same model, at 1, 2 and 4 concurrent sessions.

    tandem bench agent                       # Qwen2.5-Coder-0.5B, both sessions, c=1,2,4
    tandem bench agent --short               # 1 session, 2 turns, c=1, the tiny agent model
    tandem bench agent --sessions claude-code-2.1,codex-0.171   # the capture-server sessions
    tandem bench agent --peer none --output agent.json

Each session (bench/data/agent/, bench/agent_sessions.py) is a real client's requests,
turn by turn. At concurrency c, c copies of each session run at once, each copy with
its own tag in its first user message (one recorded session's copies at a time, so c
sessions are in flight); a copy sends its turns one after another, each as soon as the
previous answer ended (no tool time). The answers are generated live,
greedy, capped at --max-tokens; later turns carry the recorded history.

What each side is sent:
- Tandem: the client's own request (Messages or Responses API, the recorded headers
  without secrets), changed only as `REPLAY_CHANGES` says;
- mlx_lm.server (no Messages or Responses API): `/v1/completions` with the prompt text
  Tandem renders for that request, checked offline to tokenize to Tandem's prompt ids.

Per turn: time to first token, decode tok/s, prompt and cached prompt tokens (each
server's usage), output tokens; per session: wall time. Every answer is compared with
the peer's answer to the same prompt and, for the first --reference-turns turns of each
level's first copy, with plain mlx-lm greedy decoding (`generate_step`) of Tandem's
prompt ids, all parsed by Tandem's output parser. Bounded: servers on 127.0.0.1 stopped
by PID, sessions x turns x levels requests per side, --max-duration seconds in all.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.agent_client import TurnResult, comparable, stream_turn, streamed_answer
from bench.agent_render import Answer, Renderer, plain_greedy
from bench.agent_report import report_text, summarize
from bench.agent_sessions import (
    REPLAY_CHANGES,
    Session,
    find_sessions,
    replay_body,
    session_copy,
)
from bench.blas_probe import server_blas
from bench.peer import PeerConfig, running_peer, shown_command
from bench.single_stream import free_port, stop_server

ROOT = Path(__file__).resolve().parents[1]
SERVED = "bench"
PEER_ID = "default_model"
# recorded from the real CLIs against Tandem (bench/agent_record.py): Claude Code's
# Read, Edit, answer and Codex's exec_command, answer, with the server's own answers
DEFAULT_SESSIONS = ("claude-code-2.1-tandem", "codex-0.171-tandem")
PEER_SENT = {
    "chat": "/v1/chat/completions with the chat messages and tools Tandem renders for the "
    "request (checked offline to render to Tandem's prompt ids); its answer read from its "
    "own content, reasoning and tool_calls",
    "completions": "/v1/completions with the prompt text Tandem renders for the request "
    "(checked offline to tokenize to Tandem's prompt ids); its text read by Tandem's parser",
}


@dataclass(frozen=True)
class Settings:
    model: str  # resolved folder
    model_name: str  # as given
    sessions: tuple[str, ...]
    turns: int  # at most this many turns of each session (0: all)
    concurrency: tuple[int, ...]
    max_tokens: int
    peer: str
    peer_api: str  # "chat" | "completions"
    reference_turns: int
    reference_levels: tuple[int, ...]  # levels whose first copies get a reference (all: ())
    max_duration_s: float
    tandem_flags: tuple[str, ...]
    output: Path | None


@dataclass
class Planned:
    """One copy's turn: what Tandem and the peer are sent, and Tandem's prompt."""

    level: int
    copy: str
    turn: int
    surface: str
    path: str
    headers: dict[str, str]
    body: dict
    ids: tuple[int, ...]
    peer_path: str
    peer_body: dict
    peer_prompt_identical: bool
    rendered: Any


@dataclass
class Budget:
    deadline: float

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass
class SideRun:
    """One server's results: per planned turn, and per copy's session wall time."""

    name: str
    command: list[str]
    blas: dict[str, Any] = field(default_factory=dict)
    turns: dict[tuple[int, str, int], TurnResult] = field(default_factory=dict)
    answers: dict[tuple[int, str, int], Answer] = field(default_factory=dict)
    session_wall: dict[tuple[int, str], float] = field(default_factory=dict)
    level_wall: dict[int, float] = field(default_factory=dict)


# --- command line -----------------------------------------------------------------------


def parse_args(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser(prog="tandem bench agent", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model (default qwen2.5-coder-0.5b; --short: agent-tiny)")
    parser.add_argument("--sessions", help="comma-separated session names or .json paths")
    parser.add_argument("--turns", type=int, default=0, help="at most N turns a session (0: all)")
    parser.add_argument("--concurrency", default="1,2,4", help="concurrent sessions per level")
    parser.add_argument("--max-tokens", type=int, default=64, help="answer cap per turn")
    parser.add_argument("--peer", choices=("mlx_lm", "none"), default="mlx_lm")
    parser.add_argument(
        "--peer-api",
        choices=("chat", "completions"),
        default="chat",
        help="chat: Tandem's normalised messages and tools, rendered by the peer; "
        "completions: the prompt text Tandem renders",
    )
    parser.add_argument(
        "--reference-turns",
        type=int,
        default=1,
        help="compare this many turns of each level's first copy with plain mlx-lm decoding",
    )
    parser.add_argument(
        "--reference-levels",
        default="",
        help="only these concurrency levels' first copies get the plain reference (default: all;"
        " each is a cold prefill in this process)",
    )
    parser.add_argument("--max-duration", type=float, default=7200.0, help="seconds in all")
    parser.add_argument(
        "--tandem-flag", action="append", default=[], help="extra `tandem serve` flag (repeat)"
    )
    parser.add_argument("--output", type=Path, help="results JSON")
    parser.add_argument(
        "--short",
        action="store_true",
        help="1 session (claude-code-2.1-tandem), 2 turns, c=1, 16 tokens, the agent-tiny model",
    )
    args = parser.parse_args(argv)
    if args.short:
        model = args.model or "agent-tiny"
        sessions = args.sessions or DEFAULT_SESSIONS[0]
        turns, levels, max_tokens = args.turns or 2, "1", 16
        reference = max(args.reference_turns, 2)
    else:
        model = args.model or "qwen2.5-coder-0.5b"
        sessions = args.sessions or ",".join(DEFAULT_SESSIONS)
        turns, levels, max_tokens = args.turns, args.concurrency, args.max_tokens
        reference = args.reference_turns
    if args.short and args.concurrency != "1,2,4":
        levels = args.concurrency
    if args.short and args.max_tokens != 64:
        max_tokens = args.max_tokens
    return Settings(
        model=resolve(model),
        model_name=model,
        sessions=tuple(s for s in sessions.split(",") if s),
        turns=turns,
        concurrency=tuple(int(c) for c in levels.split(",")),
        max_tokens=max_tokens,
        peer=args.peer,
        peer_api=args.peer_api,
        reference_turns=reference,
        reference_levels=tuple(int(c) for c in args.reference_levels.split(",") if c),
        max_duration_s=args.max_duration,
        tandem_flags=tuple(args.tandem_flag),
        output=args.output,
    )


def resolve(name: str) -> str:
    """`agent-tiny`: the agent-client tests' tiny random model, whose tokenizer was
    trained on these clients' requests and whose context holds a whole session (the
    demo and TinyStories models hold 512-2048 tokens; Claude Code's first turn is
    ~17-19k); anything else as `tandem bench`'s other commands resolve it."""
    if name == "agent-tiny":
        from engines.model.demo import default_demo_dir

        if str(ROOT) not in sys.path:  # the model's recipe lives with the tests it serves
            sys.path.insert(0, str(ROOT))
        from tests.agent_clients.agent_model import build_agent_model

        return str(build_agent_model(default_demo_dir().parent / "bench-agent-tiny"))
    from bench.models import resolve_model

    return resolve_model(name)


# --- planning ---------------------------------------------------------------------------


def plan(settings: Settings, sessions: list[Session], renderer: Renderer) -> list[list[Planned]]:
    """Per copy (all levels), its turns in order, rendered once."""
    copies = []
    for level in settings.concurrency:
        for k in range(level):
            for session in sessions:
                tag = f"c{level}-s{k}"
                copy = session_copy(session, tag)
                turns = copy.turns[: settings.turns or None]
                copies.append(
                    [
                        planned(level, copy.name, i, t, settings, renderer)
                        for i, t in enumerate(turns)
                    ]
                )
    return copies


def planned(
    level: int, name: str, index: int, turn, settings: Settings, renderer: Renderer
) -> Planned:
    rendered = renderer.render(turn)
    body = replay_body(turn, SERVED, settings.max_tokens)
    peer = {"model": PEER_ID, "max_tokens": settings.max_tokens, "temperature": 0}
    peer |= {"stream": True, "stream_options": {"include_usage": True}}
    if settings.peer_api == "completions":
        path, prompt = "/v1/completions", peer_text(renderer, rendered.text, rendered.ids)
        identical = list(renderer.tokenizer.encode(prompt)) == list(rendered.ids)
        peer["prompt"] = prompt
    else:
        path, messages = "/v1/chat/completions", renderer.peer_messages(rendered)
        identical = messages is not None
        peer["messages"] = messages if messages is not None else rendered.messages
        if rendered.tools:
            peer["tools"] = rendered.tools
    return Planned(
        level, name, index, turn.surface, turn.path, turn.headers, body,
        rendered.ids, path, peer, identical, rendered,
    )  # fmt: skip


def peer_text(renderer: Renderer, text: str, ids: tuple[int, ...]) -> str:
    """The completion prompt that tokenizes to `ids` on the peer, which encodes with
    special tokens: a template that writes BOS itself loses it here, or it is doubled."""
    bos = renderer.tokenizer.bos_token
    if bos and text.startswith(bos) and list(renderer.tokenizer.encode(text))[1:] == list(ids):
        return text[len(bos) :]
    return text


# --- running ----------------------------------------------------------------------------


async def run_copy(
    client: httpx.AsyncClient, base: str, side: SideRun, turns: list[Planned], budget: Budget
) -> None:
    started = time.perf_counter()
    for turn in turns:
        key = (turn.level, turn.copy, turn.turn)
        if budget.left() <= 0:
            side.turns[key] = TurnResult(error="max-duration reached")
            continue
        if side.name == "tandem":
            url, surface, body, headers = base + turn.path, turn.surface, turn.body, turn.headers
        else:
            url, body, headers = base + turn.peer_path, turn.peer_body, {}
            surface = "completions" if turn.peer_path == "/v1/completions" else "chat"
        result, got = await stream_turn(client, url, surface, body, headers, budget.left())
        side.turns[key] = result
        side.answers[key] = streamed_answer(got)
        print(f"  {side.name} {turn.copy} t{turn.turn + 1}: {progress(result)}", file=sys.stderr)
        result.raw_text = "".join(got.content)
    side.session_wall[(turns[0].level, turns[0].copy)] = time.perf_counter() - started


async def run_levels(base: str, side: SideRun, copies: list[list[Planned]], budget: Budget) -> None:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        for level in sorted({c[0].level for c in copies}):
            side.level_wall[level] = 0.0
            for name in dict.fromkeys(base_name(c[0].copy) for c in copies):
                group = [c for c in copies if c[0].level == level and base_name(c[0].copy) == name]
                started = time.perf_counter()
                await asyncio.gather(*(run_copy(client, base, side, c, budget) for c in group))
                side.level_wall[level] += time.perf_counter() - started
            print(f"  {side.name} c={level}: {side.level_wall[level]:.1f}s", file=sys.stderr)


def progress(result: TurnResult) -> str:
    """One finished turn, for a long run's log (stderr)."""
    if result.error:
        return f"ERROR {result.error}"
    return (
        f"prompt {result.prompt_tokens} cached {result.cached_tokens} out "
        f"{result.output_tokens} ttft {result.ttft_s or 0:.2f}s e2e {result.e2e_s:.2f}s"
    )


def base_name(copy: str) -> str:
    return copy.split("#")[0]


def warm(base: str, surface_path: str) -> None:
    """One short request first, so model load and first-call costs are not a turn's."""
    body = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if surface_path == "completions":
        body = {"model": PEER_ID, "prompt": "hi", "max_tokens": 2, "temperature": 0}
        httpx.post(f"{base}/v1/completions", json=body, timeout=300)
        return
    httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300)


def run_tandem(settings: Settings, copies: list[list[Planned]], budget: Budget) -> SideRun:
    port = free_port()
    tandem = str(Path(sys.executable).parent / "tandem")
    command = [tandem, "serve", settings.model, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--served-model-name", SERVED, "--log-level", "warning"]
    # a prefix cache on disk of its own: prefixes an earlier run left there would be
    # hits the peer, starting cold, cannot have (a later --tandem-flag can override)
    disk = tempfile.mkdtemp(prefix="tandem-bench-agent-prefix-")
    command += ["--prefix-cache-dir", disk, *settings.tandem_flags]
    log = Path(tempfile.gettempdir()) / f"tandem-bench-agent-{port}.log"
    proc = start_tandem(command, port, log)
    shown = ["tandem", "serve", settings.model, *settings.tandem_flags]
    side = SideRun("tandem", shown)
    try:
        base = f"http://127.0.0.1:{port}"
        warm(base, "chat")
        side.blas = server_blas(base, None)
        asyncio.run(run_levels(base, side, copies, budget))
    finally:
        stop_server(proc)
        shutil.rmtree(disk, ignore_errors=True)
    return side


def start_tandem(command: list[str], port: int, log: Path, timeout_s: float = 900.0):
    """`tandem serve` started and healthy. Not `start_process`'s 300 s: a 0.5B float32
    model took 190 s to load and measure its costs on this loaded 2-core box."""
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"tandem serve did not become healthy in {timeout_s:.0f}s; see {log}")


def run_peer(settings: Settings, copies: list[list[Planned]], budget: Budget) -> SideRun:
    config = PeerConfig("mlx_lm")
    side = SideRun("mlx_lm", shown_command(settings.model, config))
    with running_peer(settings.model, config) as base:
        warm(base, "completions")
        side.blas = server_blas(base, None)
        asyncio.run(run_levels(base, side, copies, budget))
    return side


def references(
    settings: Settings, copies: list[list[Planned]], renderer: Renderer
) -> tuple[dict[tuple[int, str, int], Answer], dict[str, Any]]:
    """Plain mlx-lm greedy decoding of Tandem's prompt ids, in this process (after the
    servers stopped), for the first `reference_turns` turns of each level's first copy."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from engines.platform.blas import describe_blas

    model, tokenizer = load(settings.model)
    dtypes = sorted({str(v.dtype) for _, v in tree_flatten(model.parameters())})
    info = {"dtype": dtypes, "device": str(mx.default_device()), "blas": describe_blas()}
    answers = {}
    firsts = {}  # each session's first copy at each level
    for turns in copies:
        firsts.setdefault((turns[0].level, base_name(turns[0].copy)), turns)
    for turns in firsts.values():
        if settings.reference_levels and turns[0].level not in settings.reference_levels:
            continue
        for turn in turns[: settings.reference_turns]:
            out = plain_greedy(model, tokenizer, turn.ids, settings.max_tokens)
            text = tokenizer.decode(out)
            answers[(turn.level, turn.copy, turn.turn)] = comparable(
                renderer.parse(text, turn.rendered)
            )
    return answers, info


def main(argv: list[str]) -> None:
    # SIGTERM (`timeout`, a CI's cancel) unwinds like Ctrl-C, so the servers are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settings = parse_args(argv)
    budget = Budget(time.monotonic() + settings.max_duration_s)
    sessions = find_sessions(list(settings.sessions))
    renderer = Renderer(Path(settings.model))
    copies = plan(settings, sessions, renderer)
    tandem = run_tandem(settings, copies, budget)
    peer = run_peer(settings, copies, budget) if settings.peer != "none" else None
    if peer is not None:  # the peer's text read as Tandem splits it, where the peer did not
        # split it itself: the completions API, or chat content with no tool calls
        # (mlx_lm.server parses only tagged calls; Tandem's parser also takes a bare JSON
        # call, so the same tokens would otherwise compare as different answers)
        for turns in copies:
            for turn in turns:
                key = (turn.level, turn.copy, turn.turn)
                own = peer.answers.get(key)
                unsplit = settings.peer_api == "completions" or (
                    own is not None and not own.tool_calls and not own.reasoning
                )
                if key in peer.turns and unsplit:
                    peer.answers[key] = comparable(
                        renderer.parse(peer.turns[key].raw_text, turn.rendered)
                    )
    plain, model_info = (
        references(settings, copies, renderer) if settings.reference_turns else ({}, {})
    )
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.machine()},
        "model": {"name": settings.model_name, "path": settings.model, **model_info},
        "settings": {
            "sessions": [s.name for s in sessions],
            "clients": [s.client for s in sessions],
            "turns": settings.turns or "all",
            "concurrency": list(settings.concurrency),
            "max_tokens": settings.max_tokens,
            "greedy": True,
            "reference_turns": settings.reference_turns,
            "reference_levels": list(settings.reference_levels) or "all",
            "tandem_sent": "the client's request on its own API; " + REPLAY_CHANGES,
            "peer_sent": PEER_SENT[settings.peer_api],
        },
        **summarize(copies, tandem, peer, plain),
    }
    text = report_text(result)
    print(text)
    if settings.output:
        settings.output.write_text(json.dumps(result, indent=1) + "\n")
    if not result["all_identical"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
