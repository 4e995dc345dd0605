"""`tandem bench agent`: recorded Claude Code and Codex sessions replayed against a real
`tandem serve` process (and, in the slow tier, `mlx_lm.server`), with every answer
checked against plain mlx-lm greedy decoding of the same prompt.

The model is the agent-client tests' tiny random model (tests/agent_clients/
agent_model.py): its context holds Claude Code's ~17k-token turns and a CPU prefills
them in about a second.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.agent_report import summarize
from bench.agent_sessions import find_sessions, replay_body, session_copy

ROOT = Path(__file__).resolve().parents[1]
# the short form's bound (model built beforehand): 14 s on an idle 2-core CPU, 40 s
# with the box loaded by other work
SHORT_S = 90


@pytest.fixture(scope="module")
def agent_model() -> str:
    from bench.agent import resolve

    return resolve("agent-tiny")


def run_short(tmp_path: Path, *flags: str, timeout: float) -> tuple[dict, str, float]:
    out = tmp_path / "agent.json"
    command = [sys.executable, "-m", "tandem.cli", "bench", "agent", "--short", *flags]
    started = time.monotonic()
    result = subprocess.run(
        [*command, "--output", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text()), result.stdout, elapsed


def assert_turn_figures(rows: list[dict], side: str) -> None:
    """Two turns of one Claude Code session, the second mostly served from cache."""
    first, second = (row[side] for row in rows)
    for turn in (first, second):
        assert turn["error"] is None, turn
        assert turn["prompt_tokens"] > 10000, turn  # Claude Code's system prompt and tools
        assert 0 < turn["ttft_s"] <= turn["e2e_s"], turn
        assert turn["decode_tok_s"] > 0, turn
        assert 1 <= turn["output_tokens"] <= 16, turn
    assert second["prompt_tokens"] > first["prompt_tokens"]
    # the second turn extends the first: its prompt's first turn's part comes from cache
    assert second["cached_tokens"] >= first["prompt_tokens"] - 16, (first, second)


@pytest.mark.slow
def test_short_form_against_tandem_reports_each_turn(tmp_path, agent_model):
    result, text, elapsed = run_short(tmp_path, "--peer", "none", timeout=SHORT_S * 2)
    assert elapsed < SHORT_S, f"the short form took {elapsed:.0f}s"
    assert result["model"]["path"] == agent_model
    assert result["model"]["dtype"] == ["mlx.core.float32"]
    assert result["settings"]["sessions"] == ["claude-code-2.1-tandem"]
    assert result["settings"]["concurrency"] == [1] and result["settings"]["max_tokens"] == 16
    assert list(result["sides"]) == ["tandem"]
    assert result["sides"]["tandem"]["blas"]["blas"]
    rows = result["rows"]
    assert [(r["level"], r["turn"], r["surface"]) for r in rows] == [
        (1, 1, "messages"),
        (1, 2, "messages"),
    ]
    assert_turn_figures(rows, "tandem")
    assert all(r["peer"] is None and r["tandem_vs_peer"] is None for r in rows)
    # every answer is plain mlx-lm greedy decoding's, and the report says so
    assert [r["tandem_vs_plain"] for r in rows] == [True, True]
    assert result["all_identical"] and result["errors"] == 0
    level = result["levels"][0]["tandem"]
    # which drafter drafts is the gates' call on the machine's measured costs (on a
    # loaded machine prompt lookup stayed closed and only the suffix drafter drafted)
    assert level["drafted"], "Tandem's drafting counts are reported"
    for method, (drafted, accepted) in level["drafted"].items():  # Tandem's own counts
        assert method in ("pld", "suffix", "draft", "mtp") and 0 <= accepted <= drafted
    assert level["drafted"] == {
        m: [sum(r["tandem"]["drafted"].get(m, [0, 0])[i] for r in rows) for i in (0, 1)]
        for m in level["drafted"]
    }
    assert level["mean_session_wall_s"] >= sum(r["tandem"]["e2e_s"] for r in rows) * 0.99
    assert "answers identical: 2/2" in text and "c=1 tandem" in text


def test_copies_are_distinct_conversations_with_recorded_history():
    """Each copy's tag is in every turn's first user message, so a copy's later turn
    still extends its own earlier one (cache reuse within a session, not across)."""
    names = ["claude-code-2.1", "codex-0.171", "claude-code-2.1-tandem", "codex-0.171-tandem"]
    for session in find_sessions(names):
        a, b = session_copy(session, "c2-s0"), session_copy(session, "c2-s1")
        key = "messages" if session.turns[0].surface == "messages" else "input"
        for turn_a, turn_b in zip(a.turns, b.turns, strict=True):
            assert json.dumps(turn_a.body[key]) != json.dumps(turn_b.body[key])
            assert "[bench session c2-s0]" in json.dumps(turn_a.body[key])
        for earlier, later in zip(a.turns, a.turns[1:], strict=False):
            first, second = (without_cache_marks(t.body[key]) for t in (earlier, later))
            assert second[: len(first)] == first  # the history as sent before, then more
            assert len(second) > len(first)
        body = replay_body(a.turns[0], "m", 7)
        assert body["model"] == "m" and body["temperature"] == 0 and body["stream"] is True
        assert body.get("max_tokens", body.get("max_output_tokens")) == 7


def without_cache_marks(value):
    """Claude Code moves its `cache_control` mark to the newest message each turn."""
    if isinstance(value, dict):
        return {k: without_cache_marks(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [without_cache_marks(v) for v in value]
    return value


def test_an_answer_unlike_plain_decoding_is_reported():
    from bench.agent import Planned, SideRun
    from bench.agent_client import TurnResult
    from bench.agent_render import Answer

    turn = Planned(1, "s#c1-s0", 0, "messages", "/v1/messages", {}, {}, (1, 2), "", {}, True, None)
    key = (1, "s#c1-s0", 0)
    tandem = SideRun("tandem", ["tandem"])
    tandem.turns[key] = TurnResult(ttft_s=0.1, e2e_s=0.2, output_tokens=3)
    tandem.answers[key] = Answer("hello", "", ())
    tandem.session_wall[(1, "s#c1-s0")] = 0.2
    plain = {key: Answer("hello!", "", ())}
    summary = summarize([[turn]], tandem, None, plain)
    assert summary["rows"][0]["identical"] is False
    assert not summary["all_identical"]
    assert summary["rows"][0]["plain_answer"] == "'hello!'"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_short_form_against_tandem_and_mlx_lm_server(tmp_path, agent_model):
    result, text, _ = run_short(tmp_path, timeout=500)
    assert list(result["sides"]) == ["tandem", "mlx_lm"]
    rows = result["rows"]
    assert_turn_figures(rows, "tandem")
    assert_turn_figures(rows, "peer")
    assert all(r["peer_prompt_identical"] for r in rows)  # the peer decoded Tandem's prompt
    assert [r["tandem_vs_peer"] for r in rows] == [True, True]
    assert [r["peer_vs_plain"] for r in rows] == [True, True]
    level = result["levels"][0]
    assert level["session_speedup"] > 0 and isinstance(level["meets_target"], bool)
    assert "sessions" in text and "faster on tandem than mlx_lm.server" in text
