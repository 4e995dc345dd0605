"""--tool-call-grammar auto: with tools on offer and tool_choice auto, the output is free
text in which every tagged tool call is valid for its tool. The grammar on the tiny
tokenizer (where <tool_call> is plain text), then over HTTP with the tiny model forced
to write a call with bad arguments."""

from __future__ import annotations

import json

import pytest

from engines.sample.constraints import GrammarCompiler
from tests.clients import forced_scheduler
from tests.conftest import make_client

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
TIME = {"name": "get_time", "parameters": {"type": "object"}}
GOOD = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
BAD_ARGUMENTS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": 1}}\n</tool_call>'
UNTAGGED = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def free_text_or_calls(reference):
    compiler = GrammarCompiler(reference.tokenizer)
    return compiler.text_or_tool_calls([WEATHER, TIME], "<tool_call>", "</tool_call>")


def accepts(constraint, tokenizer, *pieces: str) -> bool:
    """Whether the grammar takes the text written as these pieces, each tokenized apart,
    and could end there."""
    ids = [i for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False)]
    matcher = constraint.matcher.deep_copy()
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Just text, with <tags> and {braces}.",
        GOOD,
        f"Checking.{GOOD}\n{GOOD}\nDone.",
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        UNTAGGED,  # not tagged: free text, for the untagged recogniser
    ],
)
def test_free_text_and_valid_tagged_calls_are_allowed(free_text_or_calls, reference, text):
    assert accepts(free_text_or_calls, reference.tokenizer, text)


@pytest.mark.parametrize(
    "pieces",
    [
        (BAD_ARGUMENTS,),
        ('<tool_call>\n{"name": "get_forecast", "arguments": {}}\n</tool_call>',),
        ('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',),  # no city
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',),  # unclosed
        # a key the schema does not name, where it says nothing of others: closed
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "P", "x": 1}}\n</tool_call>',),
        ("Text, then <tool_call>", " and more text"),
        ("Spelled apart: <", "tool", "_call>", "\n{}"),
    ],
)
def test_a_tagged_call_must_be_valid_and_closed(free_text_or_calls, reference, pieces):
    assert not accepts(free_text_or_calls, reference.tokenizer, *pieces)


@pytest.fixture(scope="module")
def bare_call(reference):
    """A forced call for a template without tool markup: the bare JSON object."""
    return GrammarCompiler(reference.tokenizer).bare_tool_call([WEATHER, TIME])


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        pytest.param(UNTAGGED, True, id="a-call"),
        pytest.param('{"name": "get_time", "arguments": {}}', True, id="no-arguments"),
        pytest.param(
            '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}', True, id="all"
        ),
        pytest.param(f"Sure. {UNTAGGED}", False, id="text-before"),
        pytest.param(f"{UNTAGGED}\n{UNTAGGED}", False, id="two-calls"),
        pytest.param(GOOD, False, id="tagged"),
        pytest.param('{"name": "get_forecast", "arguments": {}}', False, id="unknown-tool"),
        pytest.param('{"name": "get_weather", "arguments": {"city": 1}}', False, id="bad-type"),
        pytest.param(
            '{"name": "get_weather", "arguments": {"city": "P", "x": 1}}', False, id="extra-key"
        ),
        pytest.param('{"arguments": {}, "name": "get_time"}', False, id="name-not-first"),
    ],
)
def test_a_bare_forced_call_is_one_json_call_and_nothing_else(bare_call, reference, text, accepted):
    assert accepts(bare_call, reference.tokenizer, text) == accepted


def test_a_schema_with_defs_is_enforced_inside_a_call(reference):
    """pydantic puts nested models in `$defs` and points at them from the schema's root;
    inside a call, the root is the call's, so the references are rebased."""
    inner = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    parameters = {
        "type": "object",
        "properties": {"place": {"$ref": "#/$defs/Place"}},
        "required": ["place"],
        "$defs": {"Place": inner},
    }
    compiler = GrammarCompiler(reference.tokenizer)
    nested = {"name": "forecast", "parameters": parameters}
    for constraint in (
        compiler.bare_tool_call([nested]),
        compiler.bare_tool_call([TIME, nested]),
        compiler.tool_call([nested], "<tool_call>", "</tool_call>"),
    ):
        good = '{"name": "forecast", "arguments": {"place": {"city": "Paris"}}}'
        tagged = "<tool_call>" in constraint.grammar
        text = f"<tool_call>\n{good}\n</tool_call>" if tagged else good
        assert accepts(constraint, reference.tokenizer, text)
        assert not accepts(constraint, reference.tokenizer, text.replace('"Paris"', "1"))


SCRIPTS = {"bad": BAD_ARGUMENTS, "good": GOOD, "untagged": UNTAGGED, "plain": "Just text."}
TOOLS = [{"type": "function", "function": WEATHER}]


@pytest.fixture(scope="module")
def forced(tiny_model_dir, reference):
    yield from forced_scheduler(tiny_model_dir, reference.tokenizer, SCRIPTS)


async def chat(scheduler, script: str, **config) -> dict:
    async with make_client(scheduler, **config) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": f"Weather? FORCE:{script}"}],
                "tools": TOOLS,
                "max_tokens": 100,
                "temperature": 0,
            },
        )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


async def test_without_the_grammar_a_call_with_bad_arguments_goes_through(forced):
    (call,) = (await chat(forced, "bad"))["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": 1}


async def test_the_grammar_keeps_bad_arguments_out_of_a_tagged_call(forced):
    choice = await chat(forced, "bad", tool_call_grammar="auto")
    for call in choice["message"].get("tool_calls") or []:
        assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
    assert choice["message"]["content"] != BAD_ARGUMENTS


async def post(scheduler, path: str, body: dict, **config) -> dict:
    async with make_client(scheduler, **config) as client:
        response = await client.post(path, json={**body, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def responses_calls(body: dict) -> list[dict]:
    return [json.loads(i["arguments"]) for i in body["output"] if i["type"] == "function_call"]


def anthropic_calls(body: dict) -> list[dict]:
    return [block["input"] for block in body["content"] if block["type"] == "tool_use"]


@pytest.mark.parametrize(
    ("path", "body", "calls"),
    [
        (
            "/v1/responses",
            {"input": "Weather? FORCE:bad", "tools": [{"type": "function", **WEATHER}]},
            responses_calls,
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 100,
                "messages": [{"role": "user", "content": "Weather? FORCE:bad"}],
                "tools": [{"name": "get_weather", "input_schema": WEATHER["parameters"]}],
            },
            anthropic_calls,
        ),
    ],
)
async def test_the_grammar_applies_on_responses_and_anthropic_too(forced, path, body, calls):
    assert calls(await post(forced, path, body)) == [{"city": 1}]
    for arguments in calls(await post(forced, path, body, tool_call_grammar="auto")):
        assert isinstance(arguments["city"], str)


@pytest.mark.parametrize("script", ["good", "untagged", "plain"])
async def test_the_grammar_leaves_valid_output_alone(forced, script):
    plain = outcome(await chat(forced, script))
    assert outcome(await chat(forced, script, tool_call_grammar="auto")) == plain
    assert bool(plain[2]) == (script != "plain")


def outcome(choice: dict) -> tuple:
    """What a client sees, less the random call ids."""
    calls = choice["message"].get("tool_calls") or []
    named = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    return choice["finish_reason"], choice["message"]["content"], named


def test_tool_call_grammar_is_a_flag_that_reaches_the_config():
    from server.cli import build_parser
    from server.serve import build_config

    def config(*flags: str):
        return build_config(build_parser().parse_args(["serve", "/models/m", *flags]))

    assert config().tool_call_grammar == "off"
    assert config("--tool-call-grammar", "auto").tool_call_grammar == "auto"
