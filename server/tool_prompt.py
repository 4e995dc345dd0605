"""Tools, earlier calls and tool results as text, for chat templates that drop them.

Many templates render `messages` only: SmolLM2's (the demo model's) and most minimal
ones ignore the `tools` they are given, and an assistant turn's `tool_calls` with them.
A model that never sees its tools cannot call them, yet the request would look served.
So the loader probes the template once (`scheduler.template_traits`) to learn what it
drops (the tools, a system turn, an earlier call, a tool result), and
`messages_for_template` writes what is dropped as text the model reads:

- the tools as a system block, merged into the system turn (as Ollama and llama.cpp
  do; into the first user turn where the template drops system turns too): each tool's
  name, description and JSON schema, and the bare `{"name": ..., "arguments": {...}}`
  shape the server reads back as a call (server/untagged_tool_calls.py);
- an earlier call as that same JSON in the assistant's text;
- a tool result, if the template drops "tool" turns, as a user turn saying whose it is.

Templates that render tools are trusted with the rest and left alone.
"""

from __future__ import annotations

import json

from scheduler.template_traits import TemplateTraits

SYSTEM_ROLES = ("system", "developer")
CALL_SHAPE = '{"name": "<tool name>", "arguments": {<arguments matching its schema>}}'


def messages_for_template(
    traits: TemplateTraits, messages: list[dict], tools: list | None
) -> tuple[list[dict], list | None]:
    """The messages and tools to give the template: unchanged where it renders tools
    (`traits`: what it renders, `scheduler.template_traits`); otherwise what it would
    drop written into the messages, and no `tools`."""
    if traits.tools:
        return messages, tools
    messages = history_as_text(messages, traits)
    if tools:
        messages = with_tool_block(messages, tool_block(tools), traits.system)
    return messages, None


def tool_block(tools: list) -> str:
    """The tools and how to call one, as the model reads them."""
    listed = "\n".join(json.dumps(tool_spec(tool), ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou can call these tools. Each line is one tool: its name, what it does, "
        f"and the JSON schema of its arguments.\n{listed}\n\nTo call a tool, reply with only "
        f"a JSON object of this form, and nothing else:\n{CALL_SHAPE}"
    )


def tool_spec(tool: dict) -> dict:
    """A chat-shaped tool's name, description and parameters."""
    function = tool.get("function", tool)
    spec = {"name": function.get("name", "")}
    if function.get("description"):
        spec["description"] = function["description"]
    spec["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
    return spec


def with_tool_block(messages: list[dict], block: str, system_rendered: bool) -> list[dict]:
    """`block` at the end of the system turn (one is added if there is none), or at the
    start of the first user turn where the template drops system turns."""
    if system_rendered:
        if messages and messages[0]["role"] in SYSTEM_ROLES:
            first = messages[0]
            content = str(first.get("content") or "")
            merged = f"{content}\n\n{block}" if content else block
            return [{**first, "content": merged}, *messages[1:]]
        return [{"role": "system", "content": block}, *messages]
    for index, message in enumerate(messages):
        if message["role"] == "user":
            content = str(message.get("content") or "")
            merged = f"{block}\n\n{content}" if content else block
            return [*messages[:index], {**message, "content": merged}, *messages[index + 1 :]]
    return [*messages, {"role": "user", "content": block}]


def history_as_text(messages: list[dict], traits: TemplateTraits) -> list[dict]:
    """Earlier calls (and results, where "tool" turns are dropped) as text. A result
    becomes a user turn, joined to a user turn beside it, so turns still alternate."""
    names = {
        call["id"]: call.get("function", call).get("name", "")
        for message in messages
        for call in message.get("tool_calls") or ()
        if call.get("id")
    }
    out: list[dict] = []
    joins: list[bool] = []  # whether out[i] is, or holds, a result written as text
    for message in messages:
        if message.get("tool_calls") and not traits.calls:
            message = calls_as_text(message)
        is_result = message["role"] == "tool" and not traits.results
        if is_result:
            message = {"role": "user", "content": result_text(message, names)}
        if out and message["role"] == out[-1]["role"] == "user" and (is_result or joins[-1]):
            joined = f"{out[-1]['content']}\n\n{message.get('content') or ''}"
            out[-1], joins[-1] = {**out[-1], "content": joined}, True
            continue
        out.append(message)
        joins.append(is_result)
    return out


def calls_as_text(message: dict) -> dict:
    """An assistant turn with its calls written after its text, in the bare JSON shape."""
    lines = [str(message["content"])] if message.get("content") else []
    for call in message["tool_calls"]:
        function = call.get("function", call)
        shape = {"name": function.get("name", ""), "arguments": function.get("arguments", {})}
        lines.append(json.dumps(shape, ensure_ascii=False))
    rest = {key: value for key, value in message.items() if key != "tool_calls"}
    return {**rest, "content": "\n".join(lines)}


def result_text(message: dict, names: dict[str, str]) -> str:
    name = message.get("name") or names.get(message.get("tool_call_id") or "", "")
    whose = f"the tool {name}" if name else "a tool"
    return f"Result from {whose}:\n{message.get('content') or ''}"
