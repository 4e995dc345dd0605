"""What coding agents send, served: max_tokens that fits, Anthropic Messages as Claude
Code uses it, the Responses API as Codex CLI uses it, keep-alives while a stream is
quiet. Real engines and the real HTTP stack, on the tiny model (forced where a tool
call must be written)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid

import pytest

from server.keepalive import with_keepalive
from server.prompts import fold_late_system_turns, media_placeholder
from tests.clients import forced_scheduler
from tests.conftest import MODEL_NAME, make_client, start_scheduler

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES, COUNT, RESPONSES = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"
HI = [{"role": "user", "content": "Hi"}]

NS_CALL = '<tool_call>\n{"name": "crm.lookup", "arguments": {"id": "42"}}\n</tool_call>'
PATCH = "*** Begin Patch\n*** Add File: a.py\n+x = 1\n*** End Patch"
CUSTOM_CALL = (
    '<tool_call>\n{"name": "apply_patch", "arguments": {"input": ' + json.dumps(PATCH) + "}}"
    "\n</tool_call>"
)
SHELL_CALL = (
    '<tool_call>\n{"name": "local_shell", "arguments": {"command": ["ls", "-l"], '
    '"working_directory": "/tmp"}}\n</tool_call>'
)
REASONED = "<think>Look the customer up first.</think>" + NS_CALL
SCRIPTS = {
    "ns": NS_CALL,
    "custom": CUSTOM_CALL,
    "shell": SHELL_CALL,
    "reasoned": REASONED,
    "plain": "Done.",
}
CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
    {
        "type": "namespace",
        "name": "crm",
        "description": "Customer records.",
        "tools": [
            {
                "type": "function",
                "name": "lookup",
                "description": "Find a customer.",
                "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
            }
        ],
    },
    {
        "type": "custom",
        "name": "apply_patch",
        "description": "Edit files.",
        "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin"'},
    },
    {"type": "local_shell"},
    {"type": "web_search", "external_web_access": False},
]


@pytest.fixture(scope="module")
def agent_scheduler(tiny_model_dir):
    from mlx_lm import load

    _, tokenizer = load(str(tiny_model_dir))
    yield from forced_scheduler(tiny_model_dir, tokenizer, SCRIPTS)


def metric_value(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --- max_tokens that fits ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "read"),
    [
        (CHAT, {"messages": HI, "max_tokens": 32000}, lambda r: r["choices"][0]["finish_reason"]),
        (
            CHAT,
            {"messages": HI, "max_completion_tokens": 8000},
            lambda r: r["choices"][0]["finish_reason"],
        ),
        (COMPLETIONS, {"prompt": "Hi", "max_tokens": 10**9}, lambda r: r["choices"][0][
            "finish_reason"]),
        (MESSAGES, {"messages": HI, "max_tokens": 32000}, lambda r: r["stop_reason"]),
        (RESPONSES, {"input": "Hi", "max_output_tokens": 10**6}, lambda r: r["status"]),
    ],
    ids=["chat", "chat-completion-tokens", "completions", "messages", "responses"],
)  # fmt: skip
async def test_max_tokens_above_the_cap_is_served_up_to_it(scheduler, path, body, read):
    async with make_client(scheduler, max_tokens=6) as http:
        reply = await http.post(path, json={**body, "ignore_eos": True, "temperature": 0})
    assert reply.status_code == 200, reply.text
    result = reply.json()
    assert read(result) in ("length", "max_tokens", "incomplete")
    usage = result["usage"]
    assert usage.get("completion_tokens", usage.get("output_tokens")) == 6


async def test_max_tokens_beyond_the_context_is_cut_to_the_room_left(scheduler):
    context = scheduler.model_info.context_length
    prompt = [5] * (context - 4)
    async with make_client(scheduler) as http:
        reply = await http.post(
            COMPLETIONS, json={"prompt": prompt, "max_tokens": 100, "ignore_eos": True}
        )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    assert reply.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": HI, "max_tokens": 7}, "max_tokens"),
        (CHAT, {"messages": HI, "max_completion_tokens": 7}, "max_completion_tokens"),
        (RESPONSES, {"input": "Hi", "max_output_tokens": 7}, "max_output_tokens"),
    ],
)
async def test_strict_max_tokens_keeps_the_refusal_naming_the_field(scheduler, path, body, param):
    async with make_client(scheduler, max_tokens=6, strict_max_tokens=True) as http:
        refused = await http.post(path, json=body)
        anthropic = await http.post(MESSAGES, json={"messages": HI, "max_tokens": 7})
        fits = await http.post(path, json={**body, param: 6})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    assert "above this server's limit of 6" in refused.json()["error"]["message"]
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
    assert fits.status_code == 200, fits.text


async def test_a_prompt_that_leaves_no_room_is_context_length_exceeded_everywhere(scheduler):
    context = scheduler.model_info.context_length
    words = " ".join(["hello"] * context)
    async with make_client(scheduler) as http:
        chat = await http.post(CHAT, json={"messages": [{"role": "user", "content": words}]})
        msgs = await http.post(
            MESSAGES, json={"max_tokens": 5, "messages": [{"role": "user", "content": words}]}
        )
        resp = await http.post(RESPONSES, json={"input": words})
        ok = await http.post(CHAT, json={"messages": HI, "max_tokens": 2})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    assert msgs.status_code == 400 and "prompt is too long" in msgs.json()["error"]["message"]
    assert ok.status_code == 200


# --- Anthropic Messages as Claude Code sends it -----------------------------------------


def claude_code_like(system_text: str, question: str) -> dict:
    """The shape of Claude Code 2.1's first request (tests/data/agent_requests)."""
    return {
        "model": MODEL_NAME,
        "max_tokens": 32000,
        "stream": False,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
            {"type": "text", "text": system_text, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>date</system-reminder>"},
                    {"type": "text", "text": question, "cache_control": {"type": "ephemeral"}},
                ],
            },
            {"role": "system", "content": "Available agent types: claude, Explore."},
        ],
        "tools": [
            {"name": "Edit", "description": "Edit a file.", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        ],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": json.dumps({"device_id": "0" * 64, "session_id": "s"})},
        "temperature": 0,
    }


def template_opening(tokenizer) -> int:
    """Tokens every Claude Code-shaped prompt starts with (the template's own opening)."""
    from server.anthropic.prompt import render_prompt, template_tools
    from server.anthropic.schemas import MessagesRequest

    ids = []
    for system in ("a", "b"):
        body = MessagesRequest.model_validate(claude_code_like(system, "?"))
        body.system[0].text = system  # type: ignore[union-attr]
        ids.append(render_prompt(tokenizer, body, template_tools(body), None).ids)
    return next(i for i, (x, y) in enumerate(zip(*ids, strict=False)) if x != y)


async def test_claude_code_shaped_request_is_served_with_cache_accounting(scheduler):
    body = claude_code_like("You are an agent.", "Add a function div.")
    unique = body["system"][0]  # an earlier module's Claude Code-shaped prompt shares none
    unique["text"] = f"zq{uuid.uuid4().hex} {unique['text']}"  # not digits: time_ns shares
    opening = template_opening(scheduler.model_info.tokenizer)
    headers = {"anthropic-beta": "claude-code-20250219,context-management-2025-06-27"}
    async with make_client(scheduler) as http:
        first = await http.post(f"{MESSAGES}?beta=true", json=body, headers=headers)
        again = await http.post(f"{MESSAGES}?beta=true", json=body, headers=headers)
        counted = await http.post(f"{COUNT}?beta=true", json=body)
        metrics = (await http.get("/metrics")).text
    assert first.status_code == 200, first.text
    usage, prompt = first.json()["usage"], counted.json()["input_tokens"]
    # Only the template's opening tokens that every prompt starts with are read; everything
    # else up to the last cache_control mark (the question) is written.
    assert usage["cache_read_input_tokens"] <= opening
    assert 0 < usage["cache_creation_input_tokens"] < prompt
    parts = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    assert sum(usage[k] for k in parts) == prompt
    second = again.json()["usage"]
    assert second["cache_read_input_tokens"] >= usage["cache_creation_input_tokens"]
    assert second["cache_creation_input_tokens"] == 0
    assert (
        metric_value(
            metrics, "tandem_server_tools_not_offered_total", surface="messages", kind="web_search"
        )
        >= 2
    )


async def test_cache_control_marks_become_checkpoints_where_their_blocks_end(scheduler):
    from server.anthropic.prompt import render_prompt, template_tools
    from server.anthropic.schemas import MessagesRequest

    tokenizer = scheduler.model_info.tokenizer
    body = MessagesRequest.model_validate(claude_code_like("Be brief.", "Add div."))
    rendered = render_prompt(tokenizer, body, template_tools(body), None)
    text = tokenizer.decode(rendered.ids)
    ends = [tokenizer.decode(rendered.ids[:p]) for p in rendered.checkpoints]
    assert len(rendered.checkpoints) == 2, ends
    system_end, question_end = ends
    assert "Be brief." in system_end and "Add div." not in system_end
    assert question_end.rstrip().endswith("Add div.<|im_end|>") and text.startswith(question_end)


async def test_server_tools_are_left_out_of_the_prompt(scheduler):
    body = claude_code_like("Be brief.", "Add div.")
    without = {**body, "tools": body["tools"][:1]}
    async with make_client(scheduler) as http:
        with_server_tool = (await http.post(COUNT, json=body)).json()["input_tokens"]
        client_only = (await http.post(COUNT, json=without)).json()["input_tokens"]
    assert with_server_tool == client_only


async def test_images_and_documents_read_as_a_placeholder_in_turns_and_tool_results(scheduler):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [image]}
    call = {"type": "tool_use", "id": "t1", "name": "Read", "input": {"path": "a.png"}}
    tools = [{"name": "Read", "input_schema": {"type": "object"}}]

    def conversation(blocks: list) -> dict:
        return {
            "model": MODEL_NAME,
            "tools": tools,
            "messages": [
                {"role": "user", "content": "Look at a.png"},
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": blocks},
            ],
        }

    placeholder = {"type": "text", "text": media_placeholder("image")}
    async with make_client(scheduler) as http:
        shown = await http.post(COUNT, json=conversation([result, image]))
        written = await http.post(
            COUNT,
            json=conversation([{**result, "content": [placeholder]}, placeholder]),
        )
        served = await http.post(MESSAGES, json={**conversation([result]), "max_tokens": 2})
    assert shown.status_code == 200, shown.text
    assert shown.json() == written.json()
    assert served.status_code == 200, served.text
    assert served.headers["x-tandem-images-omitted"] == "1"


def test_late_system_turns_fold_into_a_user_turn_for_templates_that_refuse_them():
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "system", "content": "late"},
        {"role": "assistant", "content": "A"},
        {"role": "system", "content": "later"},
        {"role": "user", "content": "U2"},
        {"role": "system", "content": "last"},
    ]
    assert fold_late_system_turns(messages) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "late\n\nlater\n\nU2\n\nlast"},
    ]


@pytest.fixture(scope="module")
def strict_template_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a template that raises on a system turn after the first."""
    out = tmp_path_factory.mktemp("models") / "strict-template"
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('system turns only first') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config_path.write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


async def test_a_template_that_refuses_late_system_turns_still_serves_claude_code(
    strict_template_dir,
):
    scheduler = start_scheduler(strict_template_dir)
    try:
        body = claude_code_like("Be brief.", "Add div.")
        async with make_client(scheduler) as http:
            reply = await http.post(MESSAGES, json={**body, "max_tokens": 3})
            counted = await http.post(COUNT, json=body)
        assert reply.status_code == 200, reply.text
        assert counted.json()["input_tokens"] == reply.json()["usage"]["input_tokens"] + sum(
            reply.json()["usage"][k]
            for k in ("cache_read_input_tokens", "cache_creation_input_tokens")
        )
        text = scheduler.model_info.tokenizer.decode(
            scheduler.model_info.tokenizer.encode("x")
        )  # the tokenizer still works after the refusal
        assert text
    finally:
        scheduler.stop()


# --- keep-alives --------------------------------------------------------------------------


async def test_keepalive_fills_silence_without_losing_or_reordering_chunks():
    async def slow() -> object:
        yield "a"
        await asyncio.sleep(0.35)
        yield "b"
        yield "c"

    out = [chunk async for chunk in with_keepalive(slow(), 0.1, "K")]
    assert [c for c in out if c != "K"] == ["a", "b", "c"]
    assert out.count("K") >= 2 and out.index("b") > out.index("K")


async def test_keepalive_closes_the_stream_it_wraps_when_the_client_leaves():
    closed = asyncio.Event()

    async def endless() -> object:
        try:
            while True:
                await asyncio.sleep(1)
                yield "x"
        finally:
            closed.set()

    wrapped = with_keepalive(endless(), 0.05, "K")
    assert await anext(wrapped) == "K"
    await wrapped.aclose()
    assert closed.is_set()


def slow_first_token_factory(delay: float):
    """A processor that holds the request's first token for `delay` seconds: a long
    prefill, as the client sees it."""

    def factory(request) -> list:
        calls = []

        def hold(tokens, logits):
            if not calls:
                time.sleep(delay)
            calls.append(1)
            return logits

        return [hold]

    return factory


@pytest.fixture(scope="module")
def slow_scheduler(tiny_model_dir):
    scheduler = start_scheduler(
        tiny_model_dir, logits_processor_factory=slow_first_token_factory(1.0)
    )
    yield scheduler
    scheduler.stop()


KEEPALIVE_DELTA = (
    'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":null,'
    '"stop_sequence":null},"usage":{"output_tokens":0}}'
)


@pytest.mark.parametrize(
    ("path", "body", "keepalive"),
    [
        (MESSAGES, {"messages": HI, "max_tokens": 3}, KEEPALIVE_DELTA),
        (CHAT, {"messages": HI, "max_tokens": 3}, ": keep-alive"),
        (RESPONSES, {"input": "Hi", "max_output_tokens": 3}, "event: response.in_progress"),
        (COMPLETIONS, {"prompt": "Hi", "max_tokens": 3}, ": keep-alive"),
    ],
)
async def test_a_quiet_stream_sends_keepalives_before_its_first_token(
    slow_scheduler, path, body, keepalive
):
    """Each surface's keep-alive is what its agents' idle timers count: an SSE comment
    for OpenAI's chat clients, a usage-only message_delta (beside ping) for Claude Code,
    response.in_progress for Codex CLI."""
    async with make_client(slow_scheduler, stream_keepalive=0.1) as http:
        reply = await http.post(path, json={**body, "stream": True})
    frames = reply.text.split("\n\n")
    quiet = [i for i, frame in enumerate(frames) if frame.startswith(keepalive)]
    assert len(quiet) >= 2, reply.text[:600]
    if path == MESSAGES:  # before the first content block, never between blocks
        assert quiet[-1] < next(i for i, f in enumerate(frames) if "content_block_start" in f)
    assert "[DONE]" in reply.text or "message_stop" in reply.text or "completed" in reply.text


async def test_anthropic_and_openai_sdks_read_streams_with_keepalives(slow_scheduler):
    """The keep-alive events change nothing the SDKs build: the final message and
    response are what a stream without them gives."""
    import openai

    from tests.test_anthropic import sdk, sdk_http

    async with sdk_http(slow_scheduler, stream_keepalive=0.1) as http:
        async with sdk(http).messages.stream(
            model=MODEL_NAME, max_tokens=3, messages=HI, extra_body={"temperature": 0}
        ) as stream:
            message = await stream.get_final_message()
    async with make_client(slow_scheduler, stream_keepalive=0.1) as http:
        client = openai.AsyncOpenAI(api_key="k", base_url=f"{http.base_url}/v1", http_client=http)
        async with client.responses.stream(
            model=MODEL_NAME, input="Hi", max_output_tokens=3, temperature=0
        ) as stream:
            kinds = [event.type async for event in stream]
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens >= 1
    assert kinds.count("response.in_progress") >= 3  # the opening one and keep-alives
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds


async def test_keepalives_are_off_at_zero(slow_scheduler):
    async with make_client(slow_scheduler, stream_keepalive=0) as http:
        reply = await http.post(CHAT, json={"messages": HI, "max_tokens": 2, "stream": True})
    assert ": keep-alive" not in reply.text


async def test_the_openai_sdk_reads_a_stream_with_keepalives(slow_scheduler):
    from tests.clients import openai_sdk

    async with make_client(slow_scheduler, stream_keepalive=0.1) as http:
        client = openai_sdk(http)
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=HI, max_tokens=3, stream=True, temperature=0
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


# --- the Responses API as Codex CLI sends it ----------------------------------------------


def codex_body(question: str, **extra) -> dict:
    return {
        "model": MODEL_NAME,
        "input": [
            {"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "You are a coding agent."}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": question}]},
        ],
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "session-1",
        "client_metadata": {"session_id": "s", "turn_id": "t"},
        **extra,
    }  # fmt: skip


async def test_namespace_tool_call_comes_back_with_its_namespace(agent_scheduler):
    async with make_client(agent_scheduler) as http:
        reply = await http.post(RESPONSES, json=codex_body("FORCE:ns"))
        metrics = (await http.get("/metrics")).text
    assert reply.status_code == 200, reply.text
    (call,) = [item for item in reply.json()["output"] if item["type"] == "function_call"]
    assert call["namespace"] == "crm" and call["name"] == "lookup"
    assert json.loads(call["arguments"]) == {"id": "42"}
    assert (
        metric_value(
            metrics, "tandem_server_tools_not_offered_total", surface="responses", kind="web_search"
        )
        >= 1
    )


async def test_custom_tool_call_returns_its_input_string_streamed_and_not(agent_scheduler):
    async with make_client(agent_scheduler) as http:
        whole = await http.post(RESPONSES, json=codex_body("FORCE:custom"))
        streamed = await http.post(RESPONSES, json=codex_body("FORCE:custom", stream=True))
    (call,) = [item for item in whole.json()["output"] if item["type"] == "custom_tool_call"]
    assert call["name"] == "apply_patch" and call["input"] == PATCH
    events = [
        json.loads(line[len("data: ") :])
        for line in streamed.text.splitlines()
        if line.startswith("data: ")
    ]
    done = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert done and done[0]["input"] == PATCH
    final = [e for e in events if e["type"] == "response.completed"][0]["response"]
    assert final["output"][-1]["type"] == "custom_tool_call"


async def test_local_shell_call_is_an_exec_action(agent_scheduler):
    async with make_client(agent_scheduler) as http:
        reply = await http.post(RESPONSES, json=codex_body("FORCE:shell"))
    (call,) = [item for item in reply.json()["output"] if item["type"] == "local_shell_call"]
    assert call["action"] == {
        "type": "exec",
        "command": ["ls", "-l"],
        "env": {},
        "working_directory": "/tmp",
    }


async def test_stateless_turns_carry_reasoning_sealed_and_every_call_kind_back(agent_scheduler):
    """Turn 1 reasons and calls a namespaced tool; turn 2 sends everything back (store
    false): the sealed reasoning opens only for the same key and renders with the call."""
    async with make_client(agent_scheduler) as http:
        first = (await http.post(RESPONSES, json=codex_body("FORCE:reasoned"))).json()
        reasoning = [i for i in first["output"] if i["type"] == "reasoning"][0]
        assert reasoning["encrypted_content"]
        assert "Look the customer" not in reasoning["encrypted_content"]
        call = [i for i in first["output"] if i["type"] == "function_call"][0]
        history = codex_body("FORCE:plain")["input"] + [
            {"type": "reasoning", "summary": [],
             "encrypted_content": reasoning["encrypted_content"]},
            call,
            {"type": "function_call_output", "call_id": call["call_id"], "output": "found"},
            {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": PATCH},
            {"type": "custom_tool_call_output", "call_id": "c2", "output": "patched"},
            {"type": "local_shell_call", "call_id": "c3", "status": "completed",
             "action": {"type": "exec", "command": ["ls"], "env": {}}},
            {"type": "local_shell_call_output", "call_id": "c3", "output": "a.py"},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Thanks. FORCE:plain"},
                {"type": "input_image", "image_url": "data:image/png;base64,AA"}]},
        ]  # fmt: skip
        second = await http.post(RESPONSES, json={**codex_body(""), "input": history})
    assert second.status_code == 200, second.text
    assert second.json()["output"][-1]["content"][0]["text"] == "Done."


def test_sealed_reasoning_opens_only_for_its_scope_and_server():
    from server.responses.reasoning import ReasoningSealer

    sealer = ReasoningSealer()
    token = sealer.seal("key-a", "secret thoughts")
    assert sealer.open("key-a", token) == "secret thoughts"
    assert sealer.open("key-b", token) is None
    assert ReasoningSealer().open("key-a", token) is None
    assert sealer.open("key-a", token[:-4] + "AAAA") is None


def test_reasoning_text_goes_with_the_assistant_turn_that_follows_it():
    from server.responses.inputs import normalize_input
    from server.responses.schemas import ResponsesRequest

    body = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "user", "content": "q"},
                {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
                {"type": "function_call", "call_id": "c", "name": "lookup", "namespace": "crm",
                 "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "ok"},
            ]
        }
    )  # fmt: skip
    user, assistant, tool = normalize_input(body.input)
    assert assistant["reasoning_content"] == "hmm"
    assert assistant["tool_calls"][0]["function"]["name"] == "crm.lookup"
    assert tool == {"role": "tool", "tool_call_id": "c", "content": "ok"}


async def test_chat_images_read_as_a_placeholder(scheduler):
    def chat_with(part: dict) -> dict:
        return {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2}

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    text = {"type": "text", "text": media_placeholder("image")}
    async with make_client(scheduler) as http:
        shown = await http.post(CHAT, json=chat_with(image))
        written = await http.post(CHAT, json=chat_with(text))
        metrics = (await http.get("/metrics")).text
    assert shown.status_code == 200, shown.text
    assert shown.json()["usage"]["prompt_tokens"] == written.json()["usage"]["prompt_tokens"]
    # the client can tell the model read a placeholder, and so can the operator
    assert shown.headers["x-tandem-images-omitted"] == "1"
    assert "x-tandem-images-omitted" not in written.headers
    assert 'tandem_images_omitted_total{model_name="tiny",surface="chat"} 1.0' in metrics


async def test_a_forced_custom_tool_with_a_regex_grammar_writes_a_matching_input(scheduler):
    """The random tiny model writes anything it may: the grammar decides what it may."""
    import re

    tool = {
        "type": "custom",
        "name": "set_code",
        "format": {"type": "grammar", "syntax": "regex", "definition": "[a-c]{2,4}-[0-9]{2}"},
    }
    body = {
        "model": MODEL_NAME,
        "input": "Pick a code.",
        "tools": [tool],
        "tool_choice": {"type": "custom", "name": "set_code"},
        "max_output_tokens": 60,
    }
    async with make_client(scheduler) as http:
        replies = [await http.post(RESPONSES, json={**body, "seed": seed}) for seed in range(3)]
    for reply in replies:
        assert reply.status_code == 200, reply.text
        (call,) = [i for i in reply.json()["output"] if i["type"] == "custom_tool_call"]
        assert re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", call["input"]), call["input"]
