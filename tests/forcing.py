"""A test logits processor that makes the tiny random model write a chosen text.

A tiny model cannot decide to call a tool or to think, so tests drive the real
engines with a processor that, at each position after the prompt, leaves only the
scripted token: the model still runs and is verified like any output, and the
speculative engine drafts and verifies it like any other text.
"""

from __future__ import annotations

import mlx.core as mx

from engines.request import GenerationRequest

MARKER = "FORCE:"

# Scripted outputs the API tests share: a tool call, two calls, reasoning, plain text.
TOOL_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
TWO_CALLS = (
    'Checking both.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call><tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
THINKING = "<think>The user wants a greeting.</think>Hello there!"
# The parameters of the two tools those scripts call (get_weather, get_time).
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCRIPTS = {"tool": TOOL_CALL, "two": TWO_CALLS, "think": THINKING, "plain": "Just text."}


def tool_round_trip_messages(question: dict, call_id: str) -> list[dict]:
    """What the chat template should see after the TOOL_CALL round trip every surface
    tests: the question, the call with its arguments as an object, the tool's result,
    and a thanks that asks for plain text."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
    }
    return [
        question,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "Sunny, 21 C", "tool_call_id": call_id},
        {"role": "user", "content": "Thanks. FORCE:plain"},
    ]


def forced_tokens_processor(prompt_length: int, script: list[int]):
    def force(tokens: mx.array, logits: mx.array) -> mx.array:
        position = len(tokens) - prompt_length
        target = script[min(position, len(script) - 1)]
        keep = mx.arange(logits.shape[-1]) == target
        return mx.where(keep, logits, -1e9)

    return force


def forcing_factory(tokenizer, scripts: dict[str, str]):
    """`logits_processor_factory` for SchedulerConfig: a prompt containing
    "FORCE:<name>" (the last such marker counts) is answered with scripts[name], then EOS."""
    eos = min(tokenizer.eos_token_ids)
    encoded = {
        name: [*tokenizer.encode(text, add_special_tokens=False), eos]
        for name, text in scripts.items()
    }

    def factory(request: GenerationRequest) -> list:
        prompt = tokenizer.decode(list(request.prompt_tokens))
        found = {prompt.rfind(f"{MARKER}{name}"): name for name in encoded}
        last = max(found)
        if last < 0:
            return []
        return [forced_tokens_processor(len(request.prompt_tokens), encoded[found[last]])]

    return factory
