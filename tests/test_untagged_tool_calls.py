"""Tool calls written without their tags (issue 17): the recogniser behind
`OutputParser`, fed as the surfaces feed it, all at once and in small pieces."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tool_parsers import json_tools

from server.json_prefix import JsonPrefix
from server.output_parser import OutputMarkers, OutputParser, ParsedDelta

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]
# Qwen's markers and mlx-lm's parser for them, as OutputMarkers.for_tokenizer finds them.
QWEN = OutputMarkers(
    think=("<think>", "</think>"),
    tool=(json_tools.tool_call_start, json_tools.tool_call_end),
    tool_parser=json_tools.parse_tool_call,
)
STRICT = OutputMarkers(QWEN.think, QWEN.tool, QWEN.tool_parser, untagged=False)

PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
OSLO = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
CET = '{"name": "get_time", "arguments": {"zone": "CET"}}'


def parse_all(pieces: list[str], markers=QWEN, tools=TOOLS, reasoning=False) -> ParsedDelta:
    parser = OutputParser(markers, tools, reasoning)
    parts = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return ParsedDelta(
        "".join(p.content for p in parts),
        "".join(p.reasoning for p in parts),
        [call for p in parts for call in p.tool_calls],
    )


def calls_of(delta: ParsedDelta) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in delta.tool_calls]


def both_ways(text: str, **kwargs) -> ParsedDelta:
    """The parse of `text` whole, after checking that char-by-char gives the same."""
    whole = parse_all([text], **kwargs)
    by_char = parse_all(list(text), **kwargs)
    assert (by_char.content, by_char.reasoning, calls_of(by_char)) == (
        whole.content,
        whole.reasoning,
        calls_of(whole),
    )
    return whole


# --- recognised -----------------------------------------------------------------------


def test_a_bare_call_object_is_a_tool_call():
    parsed = both_ways(PARIS)
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})]
    assert parsed.content == ""


@pytest.mark.parametrize(
    "text",
    [
        f"```json\n{PARIS}\n```",
        f"```json\n{PARIS}\n```\n",
        f"\n\n```JSON\n  {PARIS}```",
        f"```\n{PARIS}\n```",
        f"  \n{PARIS}\n\n",
    ],
)
def test_a_fenced_or_padded_call_is_a_tool_call_and_the_fence_is_dropped(text):
    parsed = both_ways(text)
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})]
    assert parsed.content == ""


def test_a_list_of_calls_is_several_tool_calls_in_order():
    parsed = both_ways(f"[{OSLO}, {CET}]")
    assert calls_of(parsed) == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("get_time", {"zone": "CET"}),
    ]
    assert parsed.content == ""


def test_calls_one_after_another_are_all_recognised():
    parsed = both_ways(f"{OSLO}\n{CET}")
    assert [name for name, _ in calls_of(parsed)] == ["get_weather", "get_time"]


def test_parameters_in_place_of_arguments_is_a_call():
    parsed = both_ways('{"name": "get_time", "parameters": {"zone": "UTC"}}')
    assert calls_of(parsed) == [("get_time", {"zone": "UTC"})]


def test_text_after_a_recognised_call_is_content():
    parsed = both_ways(f"{PARIS}\n\nI asked for the weather.")
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})]
    assert parsed.content == "\n\nI asked for the weather."


def test_a_call_after_reasoning_is_recognised():
    parsed = both_ways(f"Paris, so the tool.</think>\n\n{PARIS}", reasoning=True)
    assert parsed.reasoning == "Paris, so the tool."
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})]


def test_tagged_calls_are_still_parsed_by_the_model_parser():
    parsed = both_ways(f"<tool_call>\n{PARIS}\n</tool_call>")
    assert calls_of(parsed) == [("get_weather", {"city": "Paris"})]
    assert parsed.content == ""


# --- left as text -----------------------------------------------------------------------

NOT_CALLS = [
    '{"name": "get_forecast", "arguments": {"city": "Paris"}}',  # not a declared tool
    '{"name": "get_weather", "arguments": {"city": 75}}',  # schema: city is a string
    '{"name": "get_weather", "arguments": {}}',  # schema: city is required
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": "two"}}',
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',  # arguments as text
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "id": 1}',  # an extra key
    '{"name": "get_weather"}',  # no arguments
    f"Sure! {PARIS}",  # text before the JSON
    f"I will call it:\n```json\n{PARIS}\n```",
    '{"city": "Paris", "temperature_c": 21}',  # JSON that is not a call
    '{"answer": [1, 2, 3], "done": true}',
    "[1, 2, 3]",
    '["get_weather", {"city": "Paris"}]',
    "[]",
    f"[{PARIS}, 42]",  # one call is not a call
    f"[{PARIS}, " + '{"name": "nope", "arguments": {}}]',
    '{"name": "get_weather", "arguments": {"city": "Paris"}',  # never closed
    '{"name": "get_weather", "arguments": {"city": "Par',  # cut off by max_tokens
    "```python\nprint('hi')\n```",
    "```json\n[1, 2]\n```",
    '{"name": "get_weather" "arguments": {}}',  # not JSON
    "{name: get_weather}",
    "",
    "   ",
    "Hello there!",
]


@pytest.mark.parametrize("text", NOT_CALLS)
def test_anything_else_stays_text_byte_for_byte(text):
    parsed = both_ways(text)
    assert parsed.tool_calls == []
    assert parsed.content == text


def test_without_tools_a_call_shaped_reply_is_text():
    assert both_ways(PARIS, tools=None).content == PARIS


def test_strict_tool_calls_leaves_an_untagged_call_as_text():
    parsed = both_ways(f"```json\n{PARIS}\n```", markers=STRICT)
    assert parsed.tool_calls == []
    assert parsed.content == f"```json\n{PARIS}\n```"


def test_a_candidate_cut_short_by_a_tagged_call_is_content_before_it():
    parsed = both_ways(f'{{"name": "get_weather", "arguments": <tool_call>\n{CET}\n</tool_call>')
    assert parsed.content == '{"name": "get_weather", "arguments": '
    assert calls_of(parsed) == [("get_time", {"zone": "CET"})]


# --- streaming: when text comes out --------------------------------------------------


def first_release(text: str, pieces: int = 1) -> int:
    """How many characters it takes before the parser lets any content out."""
    parser = OutputParser(QWEN, TOOLS)
    for count, char in enumerate(text, 1):
        if parser.feed(char).content:
            return count
    return len(text) + 1


@pytest.mark.parametrize(
    ("text", "released_by"),
    [
        ("Hello, the weather is", 1),
        ("  Hello", 3),
        ('{"answer": 42, "more": "' + "x" * 200, len('{"answer"')),
        (
            '{"name": "get_forecast", "arguments": {"city": "' + "x" * 200,
            len('{"name": "get_forecast"'),
        ),
        (
            '{"name": "get_weather", "arguments": "' + "x" * 200,
            len('{"name": "get_weather", "arguments": "'),
        ),
        ("```python\nimport os\n" + "x" * 200, len("```p")),
        ("[1, 2, 3" + ", 4" * 100, len("[1")),
        ('["a", "b"' + ', "c"' * 100, len('["')),
        ("{}" + " more text" * 20, len("{}")),
        ('{"name" 1' + "x" * 100, len('{"name" 1')),
        ('{"name": 1' + "x" * 100, len('{"name": 1')),
        (
            '{"name": "get_time", "arguments": [' + "x" * 100,
            len('{"name": "get_time", "arguments": ['),
        ),
    ],
)
def test_text_that_cannot_become_a_call_is_not_held_back(text, released_by):
    assert first_release(text) == released_by


def test_the_released_text_is_everything_held_and_nothing_twice():
    parser = OutputParser(QWEN, TOOLS)
    text = '```json\n{"answer": 1}\n```'
    out = "".join(parser.feed(char).content for char in text) + parser.finish().content
    assert out == text


def test_a_streamed_call_comes_out_with_the_character_that_closes_it():
    parser = OutputParser(QWEN, TOOLS)
    deltas = [parser.feed(char) for char in f"```json\n{PARIS}\n```"]
    closing = len("```json\n") + len(PARIS) - 1
    assert [i for i, d in enumerate(deltas) if d.tool_calls] == [closing]
    assert not any(d.content for d in deltas)
    assert parser.tool_calls_emitted == 1


def test_a_call_cut_by_the_end_of_output_is_released_at_finish():
    parser = OutputParser(QWEN, TOOLS)
    text = '{"name": "get_weather", "arguments": {"city": "Pa'
    assert parser.feed(text).content == ""
    assert parser.finish().content == text


# --- the JSON prefix scanner ---------------------------------------------------------

VALID = [
    '{"a": [1, -2.5e+3, 0, 0.25, -0, 1E9, true, false, null, "x\\"y\\u00e9\\n"], "b": {}}',
    '[[], {}, [{}], "\\\\"]',
    '{ "k" : { "n" : -12.0e-2 } }',
    '{"emoji": "\ud83d\ude00 caf\u00e9"}',
]
INVALID = [
    "{a: 1}",
    '{"a": 01}',
    '{"a": -}',
    '{"a": 1.}',
    '{"a": 1e}',
    '{"a": tru }',
    '{"a": "\\x"}',
    '{"a": "\\u12g4"}',
    '{"a": 1,}',
    "[1 2]",
    '{"a" 1}',
    '{"a": 1]',
    "[1}",
    '{"a": "tab\there"}',
    "{}}",
]


@pytest.mark.parametrize("text", VALID)
def test_scanner_accepts_every_prefix_of_valid_json_and_completes_at_its_end(text):
    json.loads(text)
    scanner = JsonPrefix()
    for index, char in enumerate(text):
        scanner.feed(char)
        assert not scanner.failed, text[: index + 1]
        assert scanner.complete == (index == len(text) - 1), text[: index + 1]


@pytest.mark.parametrize("text", INVALID)
def test_scanner_rejects_invalid_json_at_the_first_bad_character(text):
    with pytest.raises(ValueError) as caught:
        json.loads(text)
    scanner = JsonPrefix()
    for char in text:
        scanner.feed(char)
    assert scanner.failed or not scanner.complete
    if isinstance(caught.value, json.JSONDecodeError) and "Extra data" not in str(caught.value):
        assert scanner.failed


@pytest.mark.parametrize("text", ['"a string"', "42", "true", "null"])
def test_scanner_takes_only_an_object_or_a_list_at_the_top(text):
    scanner = JsonPrefix()
    scanner.feed(text[0])
    assert scanner.failed


def test_a_remote_ref_in_a_tool_schema_is_never_fetched():
    """An offline validator cannot compile it, so any arguments object passes."""
    tools = [{"name": "fetch", "parameters": {"$ref": "http://127.0.0.1:9/schema.json"}}]
    parsed = both_ways('{"name": "fetch", "arguments": {"url": 1}}', tools=tools)
    assert calls_of(parsed) == [("fetch", {"url": 1})]


def test_strict_tool_calls_is_a_flag_that_reaches_the_config():
    from server.cli import build_parser
    from server.serve import build_config

    def config(*flags: str):
        return build_config(build_parser().parse_args(["serve", "/models/m", *flags]))

    assert config().strict_tool_calls is False
    assert config("--strict-tool-calls").strict_tool_calls is True


def test_markers_recognise_untagged_calls_unless_strict_or_tool_parsing_is_off(reference):
    tokenizer = reference.tokenizer
    assert OutputMarkers.for_tokenizer(tokenizer).untagged
    assert not OutputMarkers.for_tokenizer(tokenizer, strict_tool_calls=True).untagged
    assert not OutputMarkers.for_tokenizer(tokenizer, tool_call_parser="none").untagged
