"""What a model's chat template renders of what it is given, probed once at load.

Many templates render `messages` only: SmolLM2's (the demo model's) and most minimal
ones ignore the `tools` they are given, and an assistant turn's `tool_calls` with them.
`probe_template` renders small probes and looks for their text, learning what the
template drops (the tools, a system turn, an earlier call, a tool result);
`server.tool_prompt` then writes what it drops as text the model reads. The loader
probes once and keeps the answer on the model's `ModelInfo`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PROBE_TOOL = "tandem_probe_tool"
PROBE_TEXT = "tandem-probe-text-7d1c"
PROBE_RESULT = "tandem-probe-result-3e9a"


@dataclass(frozen=True)
class TemplateTraits:
    """What a chat template renders of what it is given."""

    tools: bool = True  # the `tools` argument
    system: bool = True  # a system turn's content
    calls: bool = True  # an assistant turn's `tool_calls`
    results: bool = True  # a "tool" turn's content


RENDERS_ALL = TemplateTraits()


def dropped(traits: TemplateTraits) -> str:
    names = ("tools", "system turns", "earlier tool calls", "tool results")
    flags = (traits.tools, traits.system, traits.calls, traits.results)
    return ", ".join(name for name, kept in zip(names, flags, strict=True) if not kept)


def probe_template(tokenizer: Any) -> TemplateTraits:
    """Render probes and look for their text: a template renders tools when a probe
    tool's name is in its output (a template that changes its output for tools but
    never names them still leaves the model unable to call them). A template that
    renders tools is trusted with calls and results too; one that refuses even a plain
    user turn is left alone."""
    question = {"role": "user", "content": "Hi"}
    if _render(tokenizer, [question]) is None:
        return RENDERS_ALL
    if PROBE_TOOL in (_render(tokenizer, [question], [probe_tool()]) or ""):
        return RENDERS_ALL
    system = _render(tokenizer, [{"role": "system", "content": PROBE_TEXT}, question])
    call = {"id": "call_probe", "type": "function", "function": probe_call()}
    answer = {"role": "assistant", "content": "", "tool_calls": [call]}
    result = {"role": "tool", "content": PROBE_RESULT, "tool_call_id": "call_probe"}
    round_trip = _render(tokenizer, [question, answer, result, {"role": "user", "content": "Ok"}])
    return TemplateTraits(
        tools=False,
        system=PROBE_TEXT in (system or ""),
        calls=PROBE_TOOL in (round_trip or ""),
        results=PROBE_RESULT in (round_trip or ""),
    )


def probe_tool() -> dict:
    parameters = {"type": "object", "properties": {"q": {"type": "string"}}}
    return {"type": "function", "function": {"name": PROBE_TOOL, "parameters": parameters}}


def probe_call() -> dict:
    return {"name": PROBE_TOOL, "arguments": {"q": "x"}}


def _render(tokenizer: Any, messages: list[dict], tools: list | None = None) -> str | None:
    """The template's text, or None where it refuses these messages."""
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
    except Exception:  # noqa: BLE001 - templates raise arbitrary errors on input they refuse
        return None
