"""Bad input gets a clear 4xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import pytest

from tests.conftest import MODEL_NAME, make_client, start_scheduler

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}  # raw bodies below are declared JSON, like clients'

BAD_REQUESTS = [
    (COMPLETIONS, b'{"prompt": "hi", ', 400, None),
    (COMPLETIONS, b"[1, 2, 3]", 400, None),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "temperature": 5}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (COMPLETIONS, {"prompt": 42}, 400, "prompt"),
    (COMPLETIONS, {"max_tokens": 5}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "n": 2}, 400, "n"),
    (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (COMPLETIONS, {"prompt": [999999]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": [1, 2], "suffix": "x"}, 400, "prompt"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hello"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, 400, None),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    (
        CHAT,
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]},
        400,
        "tools",
    ),
    (
        CHAT,
        {
            "messages": USER,
            "tool_choice": {"type": "function", "function": {"name": "g"}},
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        400,
        "tool_choice",
    ),
    (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]},
        400,
        "messages[0].content",
    ),
    (CHAT, {"messages": USER, "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize(("path", "payload", "status", "param"), BAD_REQUESTS)
async def test_bad_input_gets_openai_shaped_4xx(client, path, payload, status, param):
    if isinstance(payload, bytes):
        response = await client.post(path, content=payload, headers=JSON)
    else:
        response = await client.post(path, json=payload)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"].startswith(param)


async def test_prompt_longer_than_context_is_400_and_server_keeps_serving(client):
    response = await client.post(COMPLETIONS, json={"prompt": [5] * 2100, "max_tokens": 4})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    ok = await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


async def test_unknown_route_and_method_are_json_errors(client):
    missing = await client.get("/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong_method = await client.get(COMPLETIONS)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


async def test_chat_on_model_without_template_is_clear_400(no_template_model_dir):
    scheduler = start_scheduler(no_template_model_dir)
    try:
        async with make_client(scheduler) as client:
            response = await client.post(CHAT, json={"model": MODEL_NAME, "messages": USER})
            assert response.status_code == 400
            assert response.json()["error"]["code"] == "no_chat_template"
            ok = await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200
    finally:
        scheduler.stop()


@pytest.mark.parametrize(
    "path", [CHAT, COMPLETIONS, "/v1/messages", "/v1/responses", "/v1/messages/count_tokens"]
)
async def test_every_surface_is_503_while_the_model_loads(tiny_model_dir, path):
    from scheduler import Scheduler, SchedulerConfig

    loading = Scheduler(SchedulerConfig(model=str(tiny_model_dir)))  # never started
    body = {"model": MODEL_NAME, "prompt": "hi", "input": "hi", "messages": USER, "max_tokens": 4}
    async with make_client(loading) as client:
        response = await client.post(path, json=body)
        assert (await client.get("/health")).status_code == 503
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"]


async def test_model_list_is_503_with_retry_after_until_the_model_is_ready(tiny_model_dir):
    from scheduler import Scheduler, SchedulerConfig

    loading = Scheduler(SchedulerConfig(model=str(tiny_model_dir)))  # never started
    async with make_client(loading) as client:
        response = await client.get("/v1/models")
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"]
    assert response.json()["error"]["type"] == "server_unavailable"


async def test_model_list_health_and_generation_share_one_readiness(tiny_model_dir):
    """The weights are in (model_info is set) but the server does not take requests:
    draining, then stopped (the same holds in the start-up warm-up, while costs are
    measured). /v1/models answers as /health and generation do, never 200 beside a
    503 on the request that follows it."""
    scheduler = start_scheduler(tiny_model_dir)
    try:
        async with make_client(scheduler) as client:
            assert (await client.get("/v1/models")).status_code == 200
            scheduler.begin_drain()
            draining = [
                await client.get("/v1/models"),
                await client.get("/health"),
                await client.post(CHAT, json={"model": MODEL_NAME, "messages": USER}),
            ]
            scheduler.stop()
            assert scheduler.model_info is not None
            stopped = [
                await client.get("/v1/models"),
                await client.get("/health"),
                await client.post(CHAT, json={"model": MODEL_NAME, "messages": USER}),
            ]
    finally:
        scheduler.stop()
    for response in draining + stopped:
        assert response.status_code == 503, response.text
    assert [r.headers.get("retry-after") is not None for r in draining][0::2] == [True, True]


async def test_model_list_names_the_model_once_ready(client):
    response = await client.get("/v1/models")
    assert response.status_code == 200
    assert response.json()["data"][0]["id"] == MODEL_NAME


@pytest.mark.parametrize(
    ("path", "shape"),
    [
        (COMPLETIONS, "openai"),
        (CHAT, "openai"),
        ("/v1/responses", "openai"),
        ("/v1/messages", "anthropic"),
        ("/v1/messages/count_tokens", "anthropic"),
    ],
)
async def test_integer_too_long_to_parse_is_a_400_in_the_surface_shape(client, path, shape):
    """Python refuses to parse integers of more than 4300 digits (a ValueError that is
    not a JSONDecodeError); that is the client's input, not a server error."""
    body = b'{"prompt": "hi", "messages": [], "input": "hi", "max_tokens": 1' + b"0" * 5000 + b"}"
    response = await client.post(path, content=body, headers=JSON)
    assert response.status_code == 400, response.text
    if shape == "anthropic":
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    else:
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert "digits" in response.text


HUGE_ARGUMENTS = '{"n": 1' + "0" * 5000 + "}"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            CHAT,
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "f", "arguments": HUGE_ARGUMENTS},
                            }
                        ],
                    },
                    {"role": "user", "content": "hi"},
                ]
            },
        ),
        (
            "/v1/responses",
            {
                "input": [
                    {
                        "type": "function_call",
                        "call_id": "c1",
                        "name": "f",
                        "arguments": HUGE_ARGUMENTS,
                    },
                    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                ]
            },
        ),
    ],
)
async def test_tool_call_arguments_too_long_to_parse_are_a_400(client, path, body):
    response = await client.post(path, json={**body, "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_model_written_arguments_too_long_to_parse_read_as_no_arguments():
    from server.output_parser import ToolCall

    assert ToolCall("f", HUGE_ARGUMENTS).arguments_object() == {}


async def test_health_names_a_failure_without_its_details(tiny_model_dir, tmp_path, reference):
    """/health is open to anyone; exception text (paths, internals) stays in the log."""
    from engines.errors import RequestAborted
    from engines.request import GenerationRequest
    from scheduler import Scheduler, SchedulerConfig

    secret = tmp_path / "secret-model-dir"
    failed = Scheduler(SchedulerConfig(model=str(secret)))
    failed.start()
    assert not failed.wait_loaded(30)
    try:
        async with make_client(failed) as client:
            response = await client.get("/health")
    finally:
        failed.stop()
    assert "secret-model-dir" in failed.error
    assert response.status_code == 503
    assert response.json() == {"status": "failed", "error": "the model failed to load"}

    broken = start_scheduler(tiny_model_dir)
    try:

        def step():
            raise RuntimeError("secret engine detail")

        broken._step = step
        prompt = tuple(reference.tokenizer.encode("hi"))
        with pytest.raises(RequestAborted):
            await broken.submit(GenerationRequest("r", prompt, 4)).collect()
        async with make_client(broken) as client:
            response = await client.get("/health")
    finally:
        broken.stop()
    assert "secret engine detail" in broken.error
    assert response.status_code == 503
    assert response.json() == {"status": "failed", "error": "the engine failed"}
