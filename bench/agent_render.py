"""What the model sees for a recorded agent turn, and what its raw text means, both by
Tandem's own code, so `mlx_lm.server` and plain mlx-lm decoding get the very prompt
Tandem decodes and their answers compare with Tandem's field by field.

`mlx_lm.server` has no Messages or Responses API: the peer is sent the prompt text
Tandem renders for the turn (`server.anthropic.prompt.render_prompt`,
`server.prompts.render_chat`) on `/v1/completions`. A raw answer (the peer's, plain
decoding's) goes through Tandem's `OutputParser` with the turn's tools, so it reads
as content, reasoning and tool calls, as Tandem's stream does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.agent_sessions import Turn


@dataclass(frozen=True)
class Answer:
    """One turn's answer, as a client reads it."""

    content: str
    reasoning: str
    tool_calls: tuple[tuple[str, str], ...]  # (name, arguments JSON text)

    def short(self, limit: int = 60) -> str:
        calls = "".join(f" +{name}({args[:20]})" for name, args in self.tool_calls)
        return repr(self.content[:limit]) + calls


@dataclass(frozen=True)
class Rendered:
    """A turn as Tandem renders it: the prompt's token ids and text, and the tools
    its output parser is given."""

    ids: tuple[int, ...]
    text: str
    tools: list | None
    starts_in_reasoning: bool
    messages: list[dict]  # the chat messages Tandem renders (the peer's chat request)


class Renderer:
    """Tandem's prompt rendering and output parsing for one model folder's tokenizer."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        from scheduler.template_traits import probe_template
        from server.output_parser import OutputMarkers

        self.tokenizer = load_tokenizer(Path(model_dir))
        self.markers = OutputMarkers.for_tokenizer(self.tokenizer)
        self.traits = probe_template(self.tokenizer)  # as the server probes it at load

    def render(self, turn: Turn) -> Rendered:
        think = self.markers.think
        if turn.surface == "messages":
            from server.anthropic.prompt import prompt_parts, render_prompt, template_tools
            from server.anthropic.schemas import MessagesRequest

            body = MessagesRequest.model_validate(turn.body)
            tools = template_tools(body)
            rendered = render_prompt(self.tokenizer, body, tools, think, traits=self.traits)
            messages = prompt_parts(body).messages
        else:
            from server.prompts import render_chat
            from server.responses.inputs import normalize_input, with_instructions
            from server.responses.schemas import ResponsesRequest
            from server.responses.tools import tool_set

            body = ResponsesRequest.model_validate(turn.body)
            tools = tool_set(body.tools, body.tool_choice).chat_tools or None
            messages = with_instructions(body.instructions, normalize_input(body.input))
            think_start = think[0] if think else None
            rendered = render_chat(self.tokenizer, messages, tools, think_start, traits=self.traits)
        ids = tuple(rendered.ids)
        return Rendered(ids, rendered.text, tools, rendered.starts_in_reasoning, messages)

    def chat_ids(self, messages: list[dict], tools: list | None) -> list[int]:
        """The prompt ids `mlx_lm.server` makes of a chat request: its template render,
        tokenized as it does (`apply_chat_template(..., tokenize=True)`)."""
        ids = self.tokenizer.apply_chat_template(
            copy.deepcopy(messages), tools=tools, add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def peer_messages(self, rendered: Rendered) -> list[dict] | None:
        """Chat messages the peer renders to exactly Tandem's prompt ids: as normalised,
        else with late system turns folded (as Tandem does when a template refuses
        them); None when neither does."""
        from server.prompts import fold_late_system_turns

        for messages in (rendered.messages, fold_late_system_turns(rendered.messages)):
            try:
                if self.chat_ids(messages, rendered.tools) == list(rendered.ids):
                    return messages
            except Exception:  # noqa: BLE001 - a template that refuses these messages
                continue
        return None

    def parse(self, text: str, rendered: Rendered) -> Answer:
        """`text` (a raw completion) as Tandem's stream would have split it."""
        from server.output_parser import OutputParser

        parser = OutputParser(self.markers, rendered.tools, rendered.starts_in_reasoning)
        parsed = parser.step(text, final=True)
        calls = tuple((call.name, call.arguments) for call in parsed.tool_calls)
        return Answer(parsed.content, parsed.reasoning, calls)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def plain_greedy(model: Any, tokenizer: Any, ids: tuple[int, ...], max_tokens: int) -> list[int]:
    """Plain mlx-lm decoding of `ids`: `generate_step`, greedy, stopping at EOS."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out: list[int] = []
    eos = set(tokenizer.eos_token_ids)
    prompt = mx.array(list(ids))
    for token, _ in generate_step(prompt, model, max_tokens=max_tokens):
        token = int(token)
        if token in eos:
            break
        out.append(token)
    return out
