"""POST /v1/messages and /v1/messages/count_tokens (Anthropic Messages), JSON and SSE.

Anthropic's content blocks become the normalised chat messages every surface renders
with `render_chat`: text blocks are joined with newlines, assistant `tool_use` blocks
become tool calls, user `tool_result` blocks become "tool" messages, and thinking blocks
from earlier turns are dropped (chat templates do not re-render past reasoning). A final
assistant message is a prefill: the reply continues its text.

Output is split by `OutputParser` and laid out as thinking / text / tool_use blocks, a
new block each time the kind changes; the JSON body and the SSE stream are built by the
same `BlockStream`, so they always agree.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from engines.errors import RequestAborted, RequestFailed
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from engines.sequence import FinishReason
from scheduler import TokenEvent
from server.anthropic.schemas import (
    CountTokensRequest,
    InputMessage,
    MessagesPrompt,
    MessagesRequest,
    Metadata,
    TextBlock,
    ThinkingBlock,
    ToolDefinition,
    ToolResultBlock,
    ToolUseBlock,
)
from server.errors import ApiError, anthropic_error_body, bad_request, from_tandem_error
from server.generation import effective_max_tokens, speculation_overrides, stop_strings
from server.http import (
    check_model,
    collect_unless_disconnected,
    config_of,
    events_until_done,
    model_info_of,
    off_the_loop,
    output_markers,
    parse_body,
    submit,
)
from server.output_parser import OutputParser, ParsedDelta, ToolCall
from server.prompts import RenderedChat, extend_chat, render_chat
from server.structured import anthropic_output_format, output_constraint

TEXT_JOIN = "\n"  # between consecutive text blocks of one turn, as vLLM joins text parts


@dataclass
class MessageJob:
    """A parsed Messages request and what formatting its output needs."""

    gen: GenerationRequest
    model: str
    tools: list | None
    starts_in_reasoning: bool


# --- Request -> normalised chat messages (pure) -------------------------------------


def misplaced_block(kind: str, where: str, role: str) -> ApiError:
    """Non-text media are refused by name; known blocks in the wrong turn say so."""
    if kind in ("text", "tool_use", "tool_result", "thinking", "redacted_thinking"):
        return bad_request(f"{where} is a '{kind}' block, which a {role} turn cannot hold", where)
    return bad_request(f"{where} is a '{kind}' block; this model accepts text only", where)


def joined_text(blocks: list, where: str, role: str) -> str:
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise misplaced_block(block.type, f"{where}[{j}]", role)
        texts.append(block.text)
    return TEXT_JOIN.join(texts)


def user_turn(message: InputMessage, index: int) -> list[dict]:
    """A user turn: one "tool" message per tool_result, then the text (if any)."""
    results, texts = [], []
    for j, block in enumerate(message.content):
        where = f"messages[{index}].content[{j}]"
        if isinstance(block, ToolResultBlock):
            content = joined_text(block.content, f"{where}.content", "tool_result")
            results.append({"role": "tool", "content": content, "tool_call_id": block.tool_use_id})
        elif isinstance(block, TextBlock):
            texts.append(block.text)
        else:
            raise misplaced_block(block.type, where, "user")
    if texts or not results:
        return [*results, {"role": "user", "content": TEXT_JOIN.join(texts)}]
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


def normalize_messages(system: list[TextBlock], messages: list[InputMessage]) -> list[dict]:
    """Anthropic's system + messages -> the plain dicts chat templates expect."""
    text = joined_text(system, "system", "system")
    normalized = [{"role": "system", "content": text}] if text else []
    for index, message in enumerate(messages):
        if message.role == "user":
            normalized.extend(user_turn(message, index))
        else:
            normalized.append(assistant_turn(message, index))
    return normalized


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


def template_tool(tool: ToolDefinition, index: int) -> dict:
    """Anthropic's {name, description, input_schema} -> the OpenAI shape templates take."""
    if tool.type not in (None, "custom"):
        raise bad_request(
            f"tools[{index}] is a '{tool.type}' server tool; this server runs client tools "
            "only (name, description, input_schema)",
            f"tools[{index}]",
        )
    if tool.input_schema is None:
        raise bad_request(f"tools[{index}].input_schema is required", f"tools[{index}]")
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema  # key order as chat's tools, for the template
    return {"type": "function", "function": function}


def template_tools(body: MessagesPrompt) -> list | None:
    """The tools the model sees: none when there are none or tool_choice is "none"."""
    if not body.tools or (body.tool_choice and body.tool_choice.type == "none"):
        return None
    return [template_tool(tool, index) for index, tool in enumerate(body.tools)]


def forced_tool(body: MessagesRequest) -> tuple[bool, str | None]:
    """(forced, tool name): tool_choice 'any' forces some tool, 'tool' the named one."""
    choice = body.tool_choice
    if choice is None or choice.type not in ("any", "tool"):
        return False, None
    if choice.type == "tool" and not choice.name:
        raise bad_request("tool_choice of type 'tool' needs a name", "tool_choice.name")
    return True, choice.name if choice.type == "tool" else None


def render_prompt(
    tokenizer: Any,
    body: MessagesPrompt,
    tools: list | None,
    think: tuple[str, str] | None,
    checkpoint_system: bool = False,
) -> RenderedChat:
    """The prompt exactly as the model sees it: template render, then any prefill."""
    history, prefill = split_prefill(body.messages)
    messages = normalize_messages(body.system, history)
    think_start = think[0] if think else None
    rendered = render_chat(
        tokenizer, messages, tools, think_start, checkpoint_system=checkpoint_system
    )
    if not prefill:
        return rendered
    in_reasoning = reasoning_after_prefill(rendered.starts_in_reasoning, prefill, think)
    return extend_chat(tokenizer, rendered, prefill, in_reasoning)


# --- Request -> engine terms (pure) -------------------------------------------------


def sampling_params(body: MessagesRequest) -> SamplingParams:
    """Anthropic's defaults: temperature 1, no top-p / top-k cut."""
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
    )


def first_set(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


def speculation(body: MessagesRequest) -> SpeculationOverrides:
    """Top-level switches win over the same switches inside `metadata`."""
    meta = body.metadata or Metadata()
    return speculation_overrides(
        first_set(body.enable_pld, meta.enable_pld),
        first_set(body.enable_draft, meta.enable_draft),
        first_set(body.num_draft_tokens, meta.num_draft_tokens),
    )


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def generation_request(
    body: MessagesRequest, prompt_ids: list[int], max_tokens: int
) -> GenerationRequest:
    return GenerationRequest(
        request_id=message_id(),
        prompt_tokens=tuple(prompt_ids),
        max_tokens=max_tokens,
        sampling=sampling_params(body),
        stop=stop_strings(body.stop_sequences),
        speculation=speculation(body),
        surface="messages",
    )


# --- Engine output -> Anthropic response (pure) -------------------------------------


def stop_reason(event: TokenEvent, tool_calls: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the final event."""
    if event.finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if event.matched_stop is not None:
        return "stop_sequence", event.matched_stop
    return ("tool_use" if tool_calls else "end_turn"), None


def message_usage(event: TokenEvent) -> dict[str, int]:
    """Anthropic counts prompt tokens read from cache apart from `input_tokens`."""
    return {
        "input_tokens": event.prompt_tokens - event.cached_tokens,
        "output_tokens": event.completion_tokens,
        "cache_read_input_tokens": event.cached_tokens,
    }


def tool_use_id(call: ToolCall) -> str:
    return f"toolu_{call.id.removeprefix('call_')}"


def empty_block(kind: str) -> dict:
    """A text or thinking block as content_block_start announces it."""
    if kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


@dataclass
class BlockStream:
    """Lays parsed output out as content blocks, in order, returning the stream events
    that build them. A new block starts whenever the kind of output changes. A text or
    thinking block opens at its first non-whitespace character: whitespace between
    blocks (the "\\n\\n" after </think>) is not worth a block of its own, and Anthropic
    refuses whitespace-only text blocks when a client sends the message back.
    Within one delta, reasoning comes before text and text before tool calls."""

    blocks: list[dict] = field(default_factory=list)
    open_kind: str | None = None
    held_kind: str | None = None
    held: str = ""  # leading whitespace waiting for its block to open

    def feed(self, delta: ParsedDelta) -> list[dict]:
        events = []
        if delta.reasoning:
            events += self._text("thinking", delta.reasoning)
        if delta.content:
            events += self._text("text", delta.content)
        for call in delta.tool_calls:
            events += self._tool_use(call)
        return events

    def close(self) -> list[dict]:
        """End of output: close the open block; held whitespace is dropped."""
        self.held_kind, self.held = None, ""
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _text(self, kind: str, text: str) -> list[dict]:
        if self.open_kind == kind:
            return [self._append(kind, text)]
        pending = self.held + text if self.held_kind == kind else text
        if not pending.strip():
            self.held_kind, self.held = kind, pending
            return []
        events = self.close()
        events.append(self._open(kind, empty_block(kind)))
        events.append(self._append(kind, pending))
        return events

    def _tool_use(self, call: ToolCall) -> list[dict]:
        events = self.close()
        block = {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": {}}
        events.append(self._open("tool_use", block))
        arguments = call.arguments_object()
        self.blocks[-1]["input"] = arguments
        delta = {"type": "input_json_delta", "partial_json": json.dumps(arguments)}
        events.append(
            {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}
        )
        return events + self.close()

    def _open(self, kind: str, block: dict) -> dict:
        self.blocks.append(dict(block))
        self.open_kind = kind
        return {
            "type": "content_block_start",
            "index": len(self.blocks) - 1,
            "content_block": block,
        }

    def _append(self, kind: str, text: str) -> dict:
        self.blocks[-1][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}


def message_shell(job: MessageJob) -> dict:
    """The message before decoding: no content, usage as far as it is known."""
    return {
        "id": job.gen.request_id,
        "type": "message",
        "role": "assistant",
        "model": job.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": len(job.gen.prompt_tokens), "output_tokens": 0},
    }


def message_delta(event: TokenEvent, tool_calls: int) -> dict:
    """The closing summary; its usage is cumulative and final (the SDK overwrites)."""
    reason, sequence = stop_reason(event, tool_calls)
    return {
        "type": "message_delta",
        "delta": {"stop_reason": reason, "stop_sequence": sequence},
        "usage": message_usage(event),
        "speculation": event.speculation,
    }


def message_json(job: MessageJob, parser: OutputParser, events: list[TokenEvent]) -> dict:
    layout = BlockStream()
    for event in events:
        layout.feed(parser.step(event.text, event.final))
    layout.close()
    last = events[-1]
    reason, sequence = stop_reason(last, parser.tool_calls_emitted)
    return {
        **message_shell(job),
        "content": layout.blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": message_usage(last),
        "speculation": last.speculation,
    }


def sse_event(payload: dict) -> str:
    """Anthropic names every event: `event: <type>` before its data line."""
    data = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n"


# --- Handlers -----------------------------------------------------------------------


def to_job(request: Request, body: MessagesRequest, model: str) -> MessageJob:
    info = model_info_of(request)
    tools = template_tools(body)
    think = output_markers(request).think
    rendered = render_prompt(info.tokenizer, body, tools, think, info.prompt_checkpoints)
    max_tokens = effective_max_tokens(
        body.max_tokens, len(rendered.ids), info.context_length, config_of(request).max_tokens
    )
    gen = generation_request(body, rendered.ids, max_tokens)
    fmt = (body.output_config.format if body.output_config else None) or body.output_format
    schema = anthropic_output_format(fmt)
    markers = output_markers(request)
    constraint = output_constraint(
        schema,
        "output_config.format",
        forced_tool(body),
        tools,
        markers,
        info,
        rendered.starts_in_reasoning,
        config_of(request).tool_call_grammar == "auto",
    )
    gen = replace(gen, constraint=constraint, checkpoints=rendered.checkpoints)
    return MessageJob(gen, model, tools, rendered.starts_in_reasoning)


async def create_message(request: Request) -> Response:
    body = await parse_body(request, MessagesRequest)
    model = check_model(config_of(request), body.model)
    job = await off_the_loop(to_job, request, body, model)
    stream = submit(request, job.gen)
    parser = OutputParser(output_markers(request), job.tools, job.starts_in_reasoning)
    if body.stream:
        events = message_events(job, parser, events_until_done(request, stream))
        return StreamingResponse(events, media_type="text/event-stream")
    events = await collect_unless_disconnected(request, stream)
    if events is None:
        return Response(status_code=499)
    return JSONResponse(message_json(job, parser, events))


async def message_events(
    job: MessageJob, parser: OutputParser, events: AsyncIterator[TokenEvent]
) -> AsyncIterator[str]:
    """message_start, ping, the blocks as they form, message_delta, message_stop; a
    failure mid-stream ends it with an `error` event in Anthropic's shape."""
    yield sse_event({"type": "message_start", "message": message_shell(job)})
    yield sse_event({"type": "ping"})
    layout = BlockStream()
    try:
        async for event in events:
            for payload in layout.feed(parser.step(event.text, event.final)):
                yield sse_event(payload)
            if event.final:
                for payload in layout.close():
                    yield sse_event(payload)
                yield sse_event(message_delta(event, parser.tool_calls_emitted))
                yield sse_event({"type": "message_stop"})
    except (RequestFailed, RequestAborted) as exc:
        yield sse_event(anthropic_error_body(from_tandem_error(exc)))


async def count_message_tokens(request: Request) -> JSONResponse:
    """The prompt's token count, rendered exactly as /v1/messages would render it."""
    body = await parse_body(request, CountTokensRequest)
    check_model(config_of(request), body.model)
    tokenizer, think = model_info_of(request).tokenizer, output_markers(request).think
    rendered = await off_the_loop(render_prompt, tokenizer, body, template_tools(body), think)
    return JSONResponse({"input_tokens": len(rendered.ids)})
