"""A Messages request -> the prompt the model sees (pure functions).

Anthropic's content blocks become the normalised chat messages every surface renders
with `render_chat`: text blocks are joined with newlines, assistant `tool_use` blocks
become tool calls, user `tool_result` blocks become "tool" messages, `system` turns
inside `messages` (Claude Code sends them) stay system turns, and thinking blocks from
earlier turns are dropped (chat templates do not re-render past reasoning). Images and
documents become a short text placeholder: this model reads text only, and an agent's
session must go on when a tool returns a screenshot (a 400 there would fail every
later turn of the session, since the block stays in its history). A final assistant
message is a prefill: the reply continues its text.

`cache_control` marks where a client wants a prefix kept: the prompt positions where
those blocks end become prompt checkpoints, and the last one decides how many prompt
tokens usage reports as written to the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from scheduler.template_traits import TemplateTraits, probe_template
from server.anthropic.schemas import (
    InputMessage,
    MessagesPrompt,
    MessagesRequest,
    OtherBlock,
    TextBlock,
    ThinkingBlock,
    ToolDefinition,
    ToolResultBlock,
    ToolUseBlock,
)
from server.errors import ApiError, bad_request
from server.image_prompts import join_blocks
from server.prompts import (
    RenderedChat,
    extend_chat,
    media_placeholder,
    prefix_length,
    render_chat,
)
from server.server_tools import server_tool_kind

if TYPE_CHECKING:
    from server.image_prompts import PromptImages

TEXT_JOIN = "\n"  # between consecutive text blocks of one turn, as vLLM joins text parts
MEDIA_BLOCKS = ("image", "document")


def misplaced_block(kind: str, where: str, role: str) -> ApiError:
    """Unknown blocks are refused by name; known blocks in the wrong turn say so."""
    if kind in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"):
        return bad_request(f"{where} is a '{kind}' block, which a {role} turn cannot hold", where)
    return bad_request(f"{where} is a '{kind}' block, which this server does not serve", where)


def block_text(block: Any, where: str, role: str) -> str:
    """A text block's text, or a media block's placeholder."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, OtherBlock) and block.type in MEDIA_BLOCKS and role != "system":
        return media_placeholder(block.type)
    raise misplaced_block(block.type, where, role)


def joined_text(blocks: list, where: str, role: str) -> str:
    texts = [block_text(b, f"{where}[{j}]", role) for j, b in enumerate(blocks)]
    return join_blocks(texts, TEXT_JOIN)


def user_turn(message: InputMessage, index: int) -> list[dict]:
    """A user turn: one "tool" message per tool_result, then the text (if any)."""
    results, texts = [], []
    for j, block in enumerate(message.content):
        where = f"messages[{index}].content[{j}]"
        if isinstance(block, ToolResultBlock):
            content = joined_text(block.content, f"{where}.content", "tool_result")
            results.append({"role": "tool", "content": content, "tool_call_id": block.tool_use_id})
        else:
            texts.append(block_text(block, where, "user"))
    if texts or not results:
        return [*results, {"role": "user", "content": join_blocks(texts, TEXT_JOIN)}]
    return results


def assistant_turn(message: InputMessage, index: int) -> dict:
    """An assistant turn: its text, and its tool_use blocks as tool calls."""
    texts, calls = [], []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            function = {"name": block.name, "arguments": block.input}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif not isinstance(block, ThinkingBlock):
            raise misplaced_block(block.type, f"messages[{index}].content[{j}]", "assistant")
    entry: dict = {"role": "assistant", "content": TEXT_JOIN.join(texts)}
    if calls:
        entry["tool_calls"] = calls
    return entry


def turn_messages(message: InputMessage, index: int) -> list[dict]:
    if message.role == "user":
        return user_turn(message, index)
    if message.role == "system":
        where = f"messages[{index}].content"
        return [{"role": "system", "content": joined_text(message.content, where, "system")}]
    return [assistant_turn(message, index)]


def normalize_messages(system: list[TextBlock], messages: list[InputMessage]) -> list[dict]:
    """Anthropic's system + messages -> the plain dicts chat templates expect."""
    return normalized_turns(system, messages)[0]


def normalized_turns(
    system: list[TextBlock], messages: list[InputMessage]
) -> tuple[list[dict], list[int]]:
    """The normalised messages, and how many of them come before the first input
    message and after each one (where a cache breakpoint on that message falls)."""
    text = joined_text(system, "system", "system")
    normalized = [{"role": "system", "content": text}] if text else []
    ends = [len(normalized)]
    for index, message in enumerate(messages):
        normalized.extend(turn_messages(message, index))
        ends.append(len(normalized))
    return normalized, ends


def split_prefill(messages: list[InputMessage]) -> tuple[list[InputMessage], str]:
    """A final assistant message is text the reply must continue (Anthropic's prefill)."""
    last = messages[-1]
    if last.role != "assistant":
        return messages, ""
    index = len(messages) - 1
    if any(isinstance(block, ToolUseBlock) for block in last.content):
        raise bad_request(
            f"messages[{index}] is a final assistant turn with tool_use blocks; a final "
            "assistant turn is a prefill and can only hold text",
            f"messages[{index}]",
        )
    texts = [block for block in last.content if not isinstance(block, ThinkingBlock)]
    return messages[:-1], joined_text(texts, f"messages[{index}].content", "assistant")


def reasoning_after_prefill(
    starts_in_reasoning: bool, prefill: str, think: tuple[str, str] | None
) -> bool:
    """Whether the reply continues inside a <think> block once the prefill is appended."""
    if not think:
        return False
    opened, closed = prefill.rfind(think[0]), prefill.rfind(think[1])
    return starts_in_reasoning if opened == closed == -1 else opened > closed


# --- tools ---------------------------------------------------------------------------


def template_tool(tool: ToolDefinition, index: int) -> dict:
    """Anthropic's {name, description, input_schema} -> the OpenAI shape templates take."""
    if tool.input_schema is None:
        raise bad_request(f"tools[{index}].input_schema is required", f"tools[{index}]")
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema  # key order as chat's tools, for the template
    return {"type": "function", "function": function}


def is_client_tool(tool: ToolDefinition) -> bool:
    """A tool the client runs from its schema; Anthropic's own typed tools (web search,
    code execution, its versioned bash and editor) are run or defined by Anthropic."""
    return tool.type in (None, "custom")


def skipped_tools(body: MessagesPrompt) -> list[str]:
    """Kinds of the server tools in the request that are not offered to the model."""
    return [server_tool_kind(t.type or "") for t in body.tools or [] if not is_client_tool(t)]


def template_tools(body: MessagesPrompt) -> list | None:
    """The tools the model sees: the client tools, none when tool_choice is "none".
    Server tools cannot run here and are left out, as a hosted model without that
    feature would; the request is still served."""
    if not body.tools or (body.tool_choice and body.tool_choice.type == "none"):
        return None
    tools = [template_tool(t, i) for i, t in enumerate(body.tools) if is_client_tool(t)]
    return tools or None


def forced_tool(body: MessagesRequest) -> tuple[bool, str | None]:
    """(forced, tool name): tool_choice 'any' forces some tool, 'tool' the named one."""
    choice = body.tool_choice
    if choice is None or choice.type not in ("any", "tool"):
        return False, None
    if choice.type == "tool" and not choice.name:
        raise bad_request("tool_choice of type 'tool' needs a name", "tool_choice.name")
    return True, choice.name if choice.type == "tool" else None


# --- cache breakpoints ------------------------------------------------------------------


def has_cache_control(block: Any) -> bool:
    extra = getattr(block, "model_extra", None) or {}
    return getattr(block, "cache_control", None) is not None or "cache_control" in extra


def breakpoint_turns(body: MessagesPrompt, history: list[InputMessage]) -> list[int]:
    """For each `cache_control` mark, how many normalised input messages precede its
    end (-1: the system prompt and tools, which come first in every template)."""
    marks = []
    if any(has_cache_control(b) for b in body.system) or any(
        has_cache_control(t) for t in body.tools or []
    ):
        marks.append(-1)
    for index, message in enumerate(history):
        for block in message.content:
            nested = getattr(block, "content", None) if isinstance(block, ToolResultBlock) else []
            if has_cache_control(block) or any(has_cache_control(b) for b in nested or []):
                marks.append(index)
                break
    return marks


@dataclass(frozen=True)
class PromptParts:
    """What rendering needs, once normalised."""

    messages: list[dict]
    ends: list[int]  # normalised messages before the first input message, after each
    prefill: str
    marks: list[int]


def prompt_parts(body: MessagesPrompt) -> PromptParts:
    history, prefill = split_prefill(body.messages)
    messages, ends = normalized_turns(body.system, history)
    return PromptParts(messages, ends, prefill, breakpoint_turns(body, history))


def breakpoint_positions(
    tokenizer: Any,
    traits: TemplateTraits,
    parts: PromptParts,
    tools: list | None,
    rendered: RenderedChat,
    images: PromptImages | None = None,
) -> tuple[int, ...]:
    """Token positions where the marked prefixes end: the prompt's common prefix with
    the template rendered for the messages up to each mark (no generation prompt)."""
    positions, escaper = set(), rendered.escaper
    for mark in parts.marks:
        count = parts.ends[mark + 1]
        prefix = parts.messages[:count] or [{"role": "user", "content": ""}]
        shared = prefix_length(tokenizer, traits, escaper, prefix, tools, rendered.ids, images)
        if 0 < shared < len(rendered.ids):
            positions.add(shared)
    return tuple(sorted(positions))


def render_prompt(
    tokenizer: Any,
    body: MessagesPrompt,
    tools: list | None,
    think: tuple[str, str] | None,
    checkpoint_system: bool = False,
    images: PromptImages | None = None,
    traits: TemplateTraits | None = None,
) -> RenderedChat:
    """The prompt exactly as the model sees it: template render, then any prefill.
    `checkpoints` holds the cache breakpoints' positions (and, with
    `checkpoint_system`, where the system prompt ends). With `images` (taken out of
    `body` first: `server.anthropic.images`), a vision model's template reads parts.
    `traits` as `render_chat` takes them."""
    parts = prompt_parts(body)
    think_start = think[0] if think else None
    traits = traits if traits is not None else probe_template(tokenizer)
    rendered = render_chat(
        tokenizer,
        parts.messages,
        tools,
        think_start,
        checkpoint_system=checkpoint_system,
        images=images,
        traits=traits,
    )
    if parts.marks and rendered.escaper is not None:
        marks = breakpoint_positions(tokenizer, traits, parts, tools, rendered, images)
        rendered = replace(rendered, checkpoints=tuple(sorted({*rendered.checkpoints, *marks})))
    if not parts.prefill:
        return rendered
    in_reasoning = reasoning_after_prefill(rendered.starts_in_reasoning, parts.prefill, think)
    return extend_chat(tokenizer, rendered, parts.prefill, in_reasoning)
