"""Structured outputs: OpenAI `response_format` (chat) and `text.format` (Responses),
Anthropic `output_config.format` -> an engine `Constraint`, so the model can only
write JSON matching the schema.

`json_object` means any JSON object; `json_schema` means the given schema (strict or
not, we always enforce it). A template that opens a think block leaves the reasoning
free and constrains what follows `</think>`.
"""

from __future__ import annotations

import logging
from typing import Any

from engines.errors import InvalidRequest
from engines.request import Constraint
from server.errors import ApiError, bad_request

log = logging.getLogger(__name__)

ANY_OBJECT = {"type": "object"}
JSON_TOOLS = "mlx_lm.tool_parsers.json_tools"


def chat_response_format(fmt: Any) -> dict | None:
    """The JSON schema a chat `response_format` asks for; None for plain text. The
    schema sits under `json_schema`: {"type": "json_schema", "json_schema": {"schema"}}."""
    return _openai_format(fmt, "response_format", nested=True)


def responses_text_format(fmt: Any) -> dict | None:
    """The JSON schema a Responses `text.format` asks for; None for plain text. The
    schema sits beside the type: {"type": "json_schema", "name", "schema"}."""
    return _openai_format(fmt, "text.format", nested=False)


def _openai_format(fmt: Any, param: str, nested: bool) -> dict | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request(f"{param} must be an object", param)
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind != "json_schema":
        raise bad_request(
            f"{param} type must be 'text', 'json_object' or 'json_schema', not {kind!r}", param
        )
    if not nested:
        return _schema_of(fmt, f"{param}.schema")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            f"{param}.json_schema must be an object with a 'schema'", f"{param}.json_schema"
        )
    return _schema_of(spec, f"{param}.json_schema.schema")


def anthropic_output_format(fmt: Any) -> dict | None:
    """The JSON schema an Anthropic `output_config.format` (or the older top-level
    `output_format`) asks for: `{"type": "json_schema", "schema": {...}}`."""
    if fmt is None:
        return None
    param = "output_config.format"
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_request("output_config.format must be {type: 'json_schema', schema}", param)
    if "schema" not in fmt:
        raise bad_request("output_config.format needs a 'schema'", param)
    return _schema_of(fmt, param)


def _schema_of(spec: dict, param: str) -> dict:
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request("the JSON schema must be an object", param)
    return schema


def openai_tool_choice(choice: Any) -> tuple[bool, str | None]:
    """(forced, tool name) from an OpenAI tool_choice: 'auto' / 'none' / 'required', or
    a named function (chat: {"type": "function", "function": {"name"}}; Responses:
    {"type": "function" | "custom", "name"})."""
    if choice in (None, "auto", "none"):
        return False, None
    if choice == "required":
        return True, None
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
        if isinstance(name, str) and name:
            return True, name
    raise bad_request(
        "tool_choice must be 'auto', 'none', 'required' or a function by name", "tool_choice"
    )


def output_constraint(
    schema: dict | None,
    schema_param: str,
    forced: tuple[bool, str | None],
    tools: list[dict] | None,
    markers,
    info,
    starts_in_reasoning: bool,
    tool_grammar: bool = False,
) -> Constraint | None:
    """What the output must match: a forced tool call, a JSON schema, free text with
    valid tool calls (`tool_grammar`, with tools on offer), or nothing. `forced` is
    (forced, tool name) from the surface's tool_choice."""
    forcing, name = forced
    if forcing and schema is not None:
        raise bad_request(f"{schema_param} cannot apply to a forced tool call", "tool_choice")
    if forcing:
        return forced_tool_constraint(
            tools, name, markers, info.grammar, info.tokenizer, starts_in_reasoning
        )
    if tool_grammar and tools and schema is None:
        return text_or_tool_calls_constraint(tools, markers, info, starts_in_reasoning)
    return constraint_for(
        schema, markers, info.grammar, info.tokenizer, starts_in_reasoning, schema_param
    )


def forced_tool_constraint(
    tools: list[dict] | None,
    forced_name: str | None,
    markers,
    grammar,
    tokenizer,
    starts_in_reasoning: bool,
    param: str = "tool_choice",
) -> Constraint:
    """One call to a tool (`forced_name`, or any of `tools`). Where the model's tool
    calls are JSON in tags (mlx-lm's `json_tools` parser: Qwen, Hermes and similar),
    in that markup; for any other template (none at all, as SmolLM2's, or another
    format) as the bare `{"name": ..., "arguments": ...}` object the server reads back
    as a call, so a forced call works on every model."""
    if not tools:
        raise bad_request("tool_choice forces a tool call, but the request has no tools", param)
    functions = [tool.get("function", tool) for tool in tools]
    if forced_name is not None:
        functions = [f for f in functions if f.get("name") == forced_name]
        if not functions:
            raise bad_request(f"tool_choice names '{forced_name}', which is not in tools", param)
    free_until = _free_until(tokenizer, markers, starts_in_reasoning, param)
    try:
        if not has_json_tags(markers):
            return grammar.bare_tool_call(functions, free_until)
        start, end = markers.tool
        return grammar.tool_call(functions, start, end, free_until)
    except InvalidRequest as exc:
        raise bad_request(f"cannot force this tool call: {exc}", param) from None


def has_json_tags(markers) -> bool:
    """Whether the model's tool calls are JSON in tags (the json_tools parser)."""
    parser = markers.tool_parser
    return markers.tool is not None and getattr(parser, "__module__", "") == JSON_TOOLS


def text_or_tool_calls_constraint(
    tools: list[dict], markers, info, starts_in_reasoning: bool
) -> Constraint | None:
    """--tool-call-grammar auto with tool_choice auto: free text, and any tagged call in
    it valid for its tool. Only for JSON-in-tags formats; where that cannot be built
    (another format, a schema llguidance refuses) the request runs unconstrained, as it
    would without the flag: the client did not ask for enforcement."""
    if not has_json_tags(markers):
        return None
    start, end = markers.tool
    functions = [tool.get("function", tool) for tool in tools]
    try:
        free_until = _free_until(info.tokenizer, markers, starts_in_reasoning, "tools")
        return info.grammar.text_or_tool_calls(functions, start, end, free_until)
    except (InvalidRequest, ApiError) as exc:
        log.warning("tool calls left unconstrained: %s", exc)
        return None


def _free_until(tokenizer, markers, starts_in_reasoning: bool, param: str) -> int | None:
    """The `</think>` token id when the template opens a think block, else None."""
    think_end = markers.think[1] if markers.think else None
    if not (starts_in_reasoning and think_end):
        return None
    ids = tokenizer.encode(think_end, add_special_tokens=False)
    if len(ids) != 1:
        raise bad_request(
            f"constrained output after a think block needs '{think_end}' to be one token", param
        )
    return ids[0]


def constraint_for(
    schema: dict | None,
    markers,
    grammar,
    tokenizer,
    starts_in_reasoning: bool,
    param: str,
) -> Constraint | None:
    """Compile `schema` for this model; a 400 naming `param` if it cannot be enforced."""
    if schema is None:
        return None
    free_until = _free_until(tokenizer, markers, starts_in_reasoning, param)
    try:
        return grammar.json_schema(schema, free_until)
    except InvalidRequest as exc:
        raise bad_request(str(exc), param) from None
