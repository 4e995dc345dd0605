"""vLLM's tokenizer routes (`/tokenize`, `/detokenize`, `/tokenizer_info`) on a real
`tandem serve` over 127.0.0.1: the model's own ids both ways, chats rendered as the chat
endpoint prefills them, enough for a client to rebuild the tokenizer, keys required, and
bad input refused with a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from server.prompts import encode_text
from tests.conftest import MODEL_NAME, make_client, start_scheduler
from tests.test_process import BLAS_PRELOAD, env_without, running_server

KEY = "tokenize-test-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
TEXTS = [
    "Once upon a time there was a robot",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Ünïcödé, 日本語 and 🤖 emoji",
    "<s>starts with the BOS text",
    "special strings inside: <|im_start|>user</s>",
    "",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Again, <|im_end|> included."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    args = [str(tiny_model_dir), "--served-model-name", MODEL_NAME, "--api-key", KEY]
    with running_server(args, env_without(*BLAS_PRELOAD, "TANDEM_API_KEY")) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    """The served model's tokenizer as mlx-lm loads it: the ground truth."""
    return load_tokenizer(tiny_model_dir)


def tokenize(http: httpx.Client, **body) -> dict:
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips_through_the_models_own_encode_and_decode(http, tokenizer, text):
    context = http.get("/v1/models").json()["data"][0]["max_model_len"]
    for flag in (True, False):
        ids = tokenizer.encode(text, add_special_tokens=flag)
        answer = tokenize(http, prompt=text, add_special_tokens=flag)
        expected = {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": None}
        assert answer == expected
        detokenized = http.post("/detokenize", json={"tokens": ids})
        assert detokenized.status_code == 200, detokenized.text
        assert detokenized.json() == {"prompt": tokenizer.decode(ids)}


@pytest.mark.parametrize("text", TEXTS[:5])
def test_a_text_prompt_by_default_is_what_completions_prefills(http, tokenizer, text):
    answer = tokenize(http, model=MODEL_NAME, prompt=text)
    assert answer["tokens"] == encode_text(tokenizer, text)  # no second BOS before "<s>..."
    completion = http.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
    assert completion.json()["usage"]["prompt_tokens"] == answer["count"]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["messages", "messages-and-tools"])
def test_chat_messages_are_the_prompt_the_chat_endpoint_prefills(http, tokenizer, tools):
    extra = {"tools": tools} if tools else {}
    answer = tokenize(http, messages=CHAT, **extra)
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, **extra})
    assert chat.status_code == 200, chat.text
    assert answer["count"] == chat.json()["usage"]["prompt_tokens"]
    assert answer["count"] == len(answer["tokens"])
    # The message's "<|im_end|>" is text, never the special id, as in the chat endpoint.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert answer["tokens"].count(im_end) == len(CHAT)


def test_chat_without_the_generation_prompt_is_the_conversation_so_far(http, tokenizer):
    messages = CHAT[:2]
    so_far = tokenize(http, messages=messages, add_generation_prompt=False)["tokens"]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert so_far == encode_text(tokenizer, expected)
    with_prompt = tokenize(http, messages=messages)["tokens"]
    assert with_prompt[: len(so_far)] == so_far and len(with_prompt) > len(so_far)


def test_add_special_tokens_on_a_chat_is_passed_to_the_tokenizer(http, tokenizer):
    rendered = tokenizer.apply_chat_template(CHAT[:2], add_generation_prompt=True, tokenize=False)
    assert rendered.startswith(tokenizer.bos_token)  # the template writes BOS itself
    default = tokenize(http, messages=CHAT[:2])["tokens"]
    assert default == encode_text(tokenizer, rendered)
    assert tokenize(http, messages=CHAT[:2], add_special_tokens=False)["tokens"] == default
    doubled = tokenize(http, messages=CHAT[:2], add_special_tokens=True)["tokens"]
    assert doubled == tokenizer.encode(rendered, add_special_tokens=True) != default


def test_token_strings_are_the_tokenizers_own(http, tokenizer):
    answer = tokenize(http, messages=CHAT[:2], return_token_strs=True)
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    answer = tokenize(http, prompt=TEXTS[2], return_token_strs=True)
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])


def test_detokenize_writes_special_tokens_out_as_vllm_does(http, tokenizer):
    ids = tokenizer.encode("Hi", add_special_tokens=True) + [tokenizer.eos_token_id]
    answer = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": ids}).json()
    assert answer["prompt"] == tokenizer.decode(ids)
    assert answer["prompt"].startswith("<s>") and answer["prompt"].endswith("</s>")


def test_tokenizer_info_is_enough_to_rebuild_the_tokenizer(http, tokenizer, tiny_model_dir):
    response = http.get("/tokenizer_info")
    assert response.status_code == 200, response.text
    info = response.json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    assert info["tokenizer_class"] == type(tokenizer._tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template
    assert info["added_tokens_decoder"]["3"] == "<|im_end|>"
    # What lm-eval's RemoteTokenizer does with it: the special tokens' ids via /tokenize.
    for name in ("eos_token", "bos_token"):
        ids = tokenize(http, prompt=info[name], add_special_tokens=False)["tokens"]
        assert ids == [getattr(tokenizer, f"{name}_id")]
    assert str(tiny_model_dir) not in response.text  # no path on this disk


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [1, 2]}),
        ("GET", "/tokenizer_info", None),
    ],
)
def test_the_routes_need_a_key_like_every_other_route(server, method, path, body):
    url = f"{server.url}{path}"
    refused = [
        httpx.request(method, url, json=body, timeout=30),
        httpx.request(method, url, json=body, headers={"authorization": "Bearer wrong"}),
    ]
    for response in refused:
        assert response.status_code == 401, response.text
        assert response.json()["error"]["type"] == "authentication_error"
    accepted = httpx.request(method, url, json=body, headers={"x-api-key": KEY}, timeout=30)
    assert accepted.status_code == 200, accepted.text


USER = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": USER}, 400, "messages"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": "hi"}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": 1}, 400, "return_token_strs"),
    ("/tokenize", {"messages": USER, "add_generation_prompt": "no"}, 400, "add_generation"),
    ("/tokenize", {"messages": USER, "chat_template": "{{ 7 * 7 }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": USER, "chat_template_kwargs": {"x": 1}}, 400, "chat_template"),
    ("/tokenize", {"messages": USER, "continue_final_message": True}, 400, "continue_final"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": 5}, 400, "tokens"),
    ("/detokenize", {"tokens": [512]}, 400, "tokens"),
    ("/detokenize", {"tokens": [2**70]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_input_is_refused_in_openais_shape_naming_the_field(http, path, body, status, param):
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"].startswith(param), error


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_a_body_that_is_not_json_is_a_400(http, path):
    for content in (b'{"prompt": "hi", ', b"[1, 2]", b'{"tokens": [1e999]}'):
        response = http.post(path, content=content, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text


def test_the_server_still_serves_after_bad_input(http, tokenizer):
    http.post("/detokenize", json={"tokens": [10**30]})
    assert tokenize(http, prompt="still here")["tokens"] == encode_text(tokenizer, "still here")


async def test_a_model_without_a_chat_template_tokenizes_text_but_refuses_messages(
    no_template_model_dir,
):
    scheduler = start_scheduler(no_template_model_dir)
    try:
        async with make_client(scheduler) as client:
            refused = await client.post("/tokenize", json={"messages": USER})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "no_chat_template"
            text = await client.post("/tokenize", json={"prompt": "hi"})
            assert text.status_code == 200 and text.json()["count"] > 0
            info = (await client.get("/tokenizer_info")).json()
            assert "chat_template" not in info and info["eos_token"] == "</s>"
    finally:
        scheduler.stop()
