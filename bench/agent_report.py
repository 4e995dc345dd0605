"""`tandem bench agent`'s results: rows per turn side by side, per-level session times
and their ratios, and which answers were identical to what.

An answer is Tandem's when it is identical to plain mlx-lm greedy decoding of the
same prompt where that was computed, else to the peer's answer (mlx_lm.server's
greedy decoding of the same prompt ids). Contents are compared stripped of leading
and trailing whitespace (Anthropic streams drop whitespace-only blocks), tool calls
by name and arguments as JSON values.
"""

from __future__ import annotations

import statistics
from typing import Any

TARGET = 1.5  # sessions complete this much faster than with mlx_lm.server (issue 42)


def figures(result) -> dict[str, Any] | None:
    return None if result is None else result.as_dict()


def summarize(copies: list, tandem, peer, plain: dict) -> dict[str, Any]:
    rows = []
    for turns in copies:
        for turn in turns:
            key = (turn.level, turn.copy, turn.turn)
            ours = tandem.answers.get(key)
            theirs = peer.answers.get(key) if peer else None
            reference = plain.get(key)
            row = {
                "level": turn.level,
                "session": turn.copy,
                "turn": turn.turn + 1,
                "surface": turn.surface,
                "prompt_ids": len(turn.ids),
                "peer_prompt_identical": turn.peer_prompt_identical,
                "tandem": figures(tandem.turns.get(key)),
                "peer": figures(peer.turns.get(key)) if peer else None,
                "tandem_vs_plain": None if reference is None else ours == reference,
                "peer_vs_plain": None
                if reference is None or theirs is None
                else theirs == reference,
                "tandem_vs_peer": None if theirs is None else ours == theirs,
                "tandem_answer": ours.short() if ours else None,
            }
            if row["tandem_vs_plain"] is False:
                row["plain_answer"] = reference.short()
            if row["tandem_vs_peer"] is False:
                row["peer_answer"] = theirs.short()
            checked = row["tandem_vs_plain"]
            row["identical"] = checked if checked is not None else row["tandem_vs_peer"]
            rows.append(row)
    levels = level_summary(copies, tandem, peer)
    errors = [r for r in rows if (r["tandem"] or {}).get("error") or (r["peer"] or {}).get("error")]
    identical = [r["identical"] for r in rows if r["identical"] is not None]
    return {
        "sides": {
            side.name: {"command": side.command, "blas": side.blas}
            for side in (tandem, peer)
            if side is not None
        },
        "rows": rows,
        "levels": levels,
        "identity": {
            "checked": len(identical),
            "identical": sum(identical),
            "tandem_vs_plain": counts(rows, "tandem_vs_plain"),
            "tandem_vs_peer": counts(rows, "tandem_vs_peer"),
            "peer_vs_plain": counts(rows, "peer_vs_plain"),
            "peer_prompt_identical": counts(rows, "peer_prompt_identical"),
        },
        "errors": len(errors),
        "all_identical": not errors and bool(identical) and all(identical),
    }


def counts(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if r[key] is not None]
    return f"{sum(values)}/{len(values)}" if values else "-"


def side_level(side, level: int, copies: list) -> dict[str, Any]:
    walls = [w for (lv, _), w in side.session_wall.items() if lv == level]
    keys = [(t.level, t.copy, t.turn) for c in copies if c[0].level == level for t in c]
    results = [side.turns[k] for k in keys if k in side.turns]
    failed = sum(1 for k in keys if k not in side.turns or side.turns[k].error)
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    rates = [r.decode_tok_s for r in results if r.decode_tok_s is not None]
    if failed:  # a session with a failed turn did less work: its time says nothing
        walls = []
    return {
        "failed_turns": failed,
        "mean_session_wall_s": statistics.mean(walls) if walls else None,
        "max_session_wall_s": max(walls) if walls else None,
        "level_wall_s": side.level_wall.get(level),
        "mean_ttft_s": statistics.mean(ttfts) if ttfts else None,
        "mean_decode_tok_s": statistics.mean(rates) if rates else None,
        "cached_tokens": sum(r.cached_tokens or 0 for r in results),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in results),
        "output_tokens": sum(r.output_tokens or 0 for r in results),
        "drafted": drafted_by_method(results),
    }


def drafted_by_method(results: list) -> dict[str, list[int]]:
    """Drafted and accepted tokens by method over `results` (Tandem's own counts)."""
    totals: dict[str, list[int]] = {}
    for result in results:
        for method, (drafted, accepted) in result.drafted.items():
            total = totals.setdefault(method, [0, 0])
            total[0] += drafted
            total[1] += accepted
    return dict(sorted(totals.items()))


def level_summary(copies: list, tandem, peer) -> list[dict[str, Any]]:
    out = []
    for level in sorted({c[0].level for c in copies}):
        ours = side_level(tandem, level, copies)
        row = {"concurrency": level, "tandem": ours}
        if peer is not None:
            theirs = side_level(peer, level, copies)
            row["peer"] = theirs
            row["session_speedup"] = ratio(
                theirs["mean_session_wall_s"], ours["mean_session_wall_s"]
            )
            row["meets_target"] = (
                None if row["session_speedup"] is None else row["session_speedup"] >= TARGET
            )
        out.append(row)
    return out


def ratio(theirs: float | None, ours: float | None) -> float | None:
    return theirs / ours if theirs and ours else None


def num(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def turn_cells(fig: dict | None) -> str:
    if fig is None:
        return f"{'-':>7} {'-':>7} {'-':>5} {'-':>7} {'-':>8} {'-':>7}"
    if fig.get("error"):
        return f"ERROR {fig['error'][:40]}"
    return (
        f"{num(fig['prompt_tokens'], 'd'):>7} {num(fig['cached_tokens'], 'd'):>7} "
        f"{num(fig['output_tokens'], 'd'):>5} {num(fig['ttft_s']):>7} "
        f"{num(fig['decode_tok_s'], '.1f'):>8} {num(fig['e2e_s']):>7}"
    )


def mark(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def report_text(result: dict[str, Any]) -> str:
    model, settings = result["model"], result["settings"]
    lines = [
        f"tandem bench agent  {result['date']}  {result['machine']['platform']}",
        f"model     {model['name']} ({model['path']}), dtype {model.get('dtype', '?')}, "
        f"device {model.get('device', '?')}",
        f"sessions  {', '.join(settings['sessions'])} ({'; '.join(settings['clients'])}), "
        f"turns {settings['turns']}, concurrency {settings['concurrency']}, "
        f"max_tokens {settings['max_tokens']}, greedy",
        f"tandem    sent {settings['tandem_sent']}",
        f"peer      sent {settings['peer_sent']}",
    ]
    for name, side in result["sides"].items():
        blas = side["blas"].get("blas", "?")
        lines.append(f"{name:<9} {' '.join(side['command'])}  [BLAS {blas}]")
    lines.append(f"plain     mlx_lm generate_step in-process [BLAS {model.get('blas', '?')}]")
    head = f"{'prompt':>7} {'cached':>7} {'out':>5} {'ttft_s':>7} {'dec t/s':>8} {'e2e_s':>7}"
    lines += ["", f"{'c':>2} {'session':<30} {'t':>2} {'side':<7} {head}  identical"]
    for row in result["rows"]:
        for side in ("tandem", "peer"):
            if side == "peer" and row["peer"] is None:
                continue
            same = (
                f"plain:{mark(row['tandem_vs_plain'])} peer:{mark(row['tandem_vs_peer'])}"
                if side == "tandem"
                else f"plain:{mark(row['peer_vs_plain'])} "
                f"prompt:{mark(row['peer_prompt_identical'])}"
            )
            lines.append(
                f"{row['level']:>2} {row['session']:<30} {row['turn']:>2} {side:<7} "
                f"{turn_cells(row[side])}  {same}"
            )
    lines += ["", "per level: mean session wall s (max) | wall s, all groups | mean ttft s | "
              "mean decode tok/s | cached/prompt tokens | Tandem's drafted/accepted tokens "
              "by method"]  # fmt: skip
    for level in result["levels"]:
        for side in ("tandem", "peer"):
            if side not in level:
                continue
            s = level[side]
            lines.append(
                f"c={level['concurrency']} {side:<7} {num(s['mean_session_wall_s'])} "
                f"({num(s['max_session_wall_s'])}) | {num(s['level_wall_s'])} | "
                f"{num(s['mean_ttft_s'])} | {num(s['mean_decode_tok_s'], '.1f')} | "
                f"{s['cached_tokens']}/{s['prompt_tokens']}"
                + "".join(f" | {m} {d}/{a}" for m, (d, a) in s["drafted"].items())
                + (f" | {s['failed_turns']} FAILED turns" if s["failed_turns"] else "")
            )
        if level.get("session_speedup") is None and "peer" in level:
            lines.append(f"c={level['concurrency']} no ratio: failed turns")
        elif "session_speedup" in level:
            lines.append(
                f"c={level['concurrency']} sessions {num(level['session_speedup'])}x faster on "
                f"tandem than mlx_lm.server (target {TARGET}x: "
                f"{'met' if level['meets_target'] else 'NOT met'})"
            )
    identity = result["identity"]
    lines += [
        "",
        f"answers identical: {identity['identical']}/{identity['checked']} "
        f"(tandem vs plain {identity['tandem_vs_plain']}, tandem vs peer "
        f"{identity['tandem_vs_peer']}, peer vs plain {identity['peer_vs_plain']}; peer prompt "
        f"token-identical {identity['peer_prompt_identical']}); errors {result['errors']}",
    ]
    for row in result["rows"]:
        if row.get("plain_answer") or row.get("peer_answer"):
            lines.append(
                f"  differs c={row['level']} {row['session']} t{row['turn']}: tandem "
                f"{row['tandem_answer']} plain {row.get('plain_answer', '=')} "
                f"peer {row.get('peer_answer', '=')}"
            )
    return "\n".join(lines)
