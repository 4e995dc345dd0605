"""The Responses API's tool kinds, as the model sees them and as calls come back.

Codex CLI and other agents list more than flat function tools:
- `namespace` tools group function (and custom) tools under a name; the model sees
  each as a function named `namespace.name`, and a call comes back as a
  `function_call` item carrying `namespace` and the inner `name`, as OpenAI returns it;
- `custom` (freeform) tools take one string (e.g. an `apply_patch` grammar): the model
  sees a function with one string parameter `input` (the grammar, if any, in its
  description), and a call comes back as a `custom_tool_call` item with that string;
- `local_shell` runs a command on the client: the model sees a function taking the
  command as an argv list, and a call comes back as a `local_shell_call` item;
- server-executed tools (`web_search`, `file_search`, `code_interpreter`, ...) cannot
  run here: they are not offered, and the request is served with the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from server.errors import bad_request
from server.output_parser import ToolCall
from server.server_tools import server_tool_kind

NAMESPACE_SEPARATOR = "."
CUSTOM_INPUT = "input"  # the one string parameter a custom tool is offered with
LOCAL_SHELL = "local_shell"
LOCAL_SHELL_PARAMETERS = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}, "description": "argv"},
        "working_directory": {"type": "string"},
        "timeout_ms": {"type": "integer"},
    },
    "required": ["command"],
}
LOCAL_SHELL_DESCRIPTION = "Run a command on the user's machine and return its output."


@dataclass(frozen=True)
class OfferedTool:
    """What a model-visible tool name stands for on the client's side."""

    kind: str  # function | custom | local_shell
    name: str  # the tool's own name (inside its namespace, if any)
    namespace: str | None = None


@dataclass
class ToolSet:
    """The tools the model is offered, and how to read its calls back."""

    chat_tools: list[dict] = field(default_factory=list)  # chat-shaped, for templates
    offered: dict[str, OfferedTool] = field(default_factory=dict)  # by model-visible name
    skipped: list[str] = field(default_factory=list)  # server tool kinds not offered

    def add(self, model_name: str, tool: OfferedTool, function: dict) -> None:
        self.offered[model_name] = tool
        self.chat_tools.append({"type": "function", "function": {"name": model_name, **function}})


def model_name(name: str, namespace: str | None) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def function_spec(tool: dict) -> dict:
    spec = {key: tool[key] for key in ("description", "parameters", "strict") if key in tool}
    spec.setdefault("parameters", {"type": "object", "properties": {}})
    return spec


def custom_spec(tool: dict) -> dict:
    """A freeform tool as a function of one string. Its grammar goes in the description
    so the model can follow it; a regex grammar is also the string's JSON-schema
    `pattern`, which the grammar machinery enforces wherever it constrains tool calls
    (a forced call, `--tool-call-grammar auto`). A Lark grammar cannot be enforced
    inside a JSON string: the client checks that input itself, as it must anyway."""
    description = str(tool.get("description") or "")
    fmt = tool.get("format") or {}
    argument: dict[str, Any] = {"type": "string"}
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and fmt.get("definition"):
        syntax, definition = fmt.get("syntax", ""), str(fmt["definition"])
        description += (
            f"\n\nThe `{CUSTOM_INPUT}` string must match this {syntax} grammar:\n{definition}"
        )
        if syntax == "regex":
            argument["pattern"] = f"^(?:{definition})$"
    parameters = {
        "type": "object",
        "properties": {CUSTOM_INPUT: argument},
        "required": [CUSTOM_INPUT],
    }
    return {"description": description.strip(), "parameters": parameters}


def add_tool(tools: ToolSet, tool: dict, param: str, namespace: str | None = None) -> None:
    kind = tool.get("type")
    if kind in ("function", "custom"):
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{param}.name must be a non-empty string", f"{param}.name")
        spec = function_spec(tool) if kind == "function" else custom_spec(tool)
        tools.add(model_name(name, namespace), OfferedTool(kind, name, namespace), spec)
    elif kind == "namespace" and namespace is None:
        add_namespace(tools, tool, param)
    elif kind == LOCAL_SHELL:
        spec = {"description": LOCAL_SHELL_DESCRIPTION, "parameters": LOCAL_SHELL_PARAMETERS}
        tools.add(LOCAL_SHELL, OfferedTool(LOCAL_SHELL, LOCAL_SHELL), spec)
    elif namespace is not None:
        raise bad_request(f"{param} is a '{kind}' tool, which a namespace cannot hold", param)
    else:
        tools.skipped.append(server_tool_kind(str(kind)))


def add_namespace(tools: ToolSet, tool: dict, param: str) -> None:
    name, inner = tool.get("name"), tool.get("tools")
    if not isinstance(name, str) or not name or not isinstance(inner, list):
        raise bad_request(f"{param} needs a name and a list of tools", param)
    for index, member in enumerate(inner):
        if not isinstance(member, dict):
            raise bad_request(f"{param}.tools[{index}] must be an object", f"{param}.tools")
        add_tool(tools, member, f"{param}.tools[{index}]", namespace=name)


def tool_set(tools: list | None, tool_choice: Any) -> ToolSet:
    """The Responses `tools` (parsed models) as offered to the model (none when
    tool_choice is "none")."""
    result = ToolSet()
    for index, tool in enumerate(tools or []):
        add_tool(result, tool.model_dump(exclude_none=True), f"tools[{index}]")
    if tool_choice == "none":
        result.chat_tools, result.offered = [], {}
    return result


# --- calls the model made -> output items -------------------------------------------------


def call_item(call: ToolCall, tools: ToolSet, item_id: str) -> dict:
    """A parsed tool call as the Responses output item its tool's kind returns."""
    tool = tools.offered.get(call.name)
    if tool is None or tool.kind == "function":
        item = {"type": "function_call", "id": item_id, "call_id": call.id}
        if tool is not None and tool.namespace:
            item["namespace"] = tool.namespace
        name = tool.name if tool is not None else call.name
        return {**item, "name": name, "arguments": call.arguments, "status": "completed"}
    arguments = call.arguments_object()
    if tool.kind == "custom":
        value = arguments.get(CUSTOM_INPUT) if isinstance(arguments, dict) else None
        text = value if isinstance(value, str) else call.arguments
        item = {"type": "custom_tool_call", "id": item_id, "call_id": call.id}
        if tool.namespace:
            item["namespace"] = tool.namespace
        return {**item, "name": tool.name, "input": text, "status": "completed"}
    command = arguments.get("command") if isinstance(arguments, dict) else None
    action = {
        "type": "exec",
        "command": [str(part) for part in command] if isinstance(command, list) else [],
        "env": {},
    }
    for key in ("working_directory", "timeout_ms"):
        if isinstance(arguments, dict) and arguments.get(key) is not None:
            action[key] = arguments[key]
    return {
        "type": "local_shell_call",
        "id": item_id,
        "call_id": call.id,
        "action": action,
        "status": "completed",
    }


# --- earlier call items (a client's input, or a stored response) -> chat tool calls ----------


def chat_tool_call(item: dict, param: str = "input") -> dict | None:
    """A call item (function, custom, local shell) as the chat tool call a template
    renders, under the name the model was offered it by; None for other items."""
    kind = item.get("type")
    if kind == "function_call":
        name = model_name(item["name"], item.get("namespace"))
        arguments = call_arguments(item["arguments"], param)
    elif kind == "custom_tool_call":
        name = model_name(item["name"], item.get("namespace"))
        arguments = {CUSTOM_INPUT: item["input"]}
    elif kind == "local_shell_call":
        name = LOCAL_SHELL
        arguments = {k: v for k, v in item["action"].items() if k not in ("type", "env")}
    else:
        return None
    function = {"name": name, "arguments": arguments}
    return {"id": item["call_id"], "type": "function", "function": function}


def call_arguments(arguments: str, param: str) -> dict:
    """Chat templates render tool-call arguments as objects, not JSON text."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError) as exc:  # also a 4300+ digit integer
        raise bad_request(f"{param}.arguments must be a JSON object: {exc}", param) from exc
    if not isinstance(value, dict):
        raise bad_request(f"{param}.arguments must be a JSON object", param)
    return value
