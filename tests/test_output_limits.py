"""Output caps and overflow refusals as agent clients need them: a reply runs to what the
client asks (or, naming nothing, to `--default-max-tokens`) up to the context's room,
not to a server-wide 4096; a prompt that does not fit is worded as OpenAI and Anthropic
word it, so litellm raises its ContextWindowExceededError and the SDKs' users (Claude
Code's compaction) recognise it. Real engines, the real HTTP stack, the real clients'
own detectors."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import

import anthropic  # noqa: E402
import httpx  # noqa: E402
import litellm  # noqa: E402
import openai  # noqa: E402
import pytest  # noqa: E402
from litellm.litellm_core_utils.exception_mapping_utils import ExceptionCheckers

from server.generation import MaxTokens, effective_max_tokens
from tests.conftest import MODEL_NAME, make_client, start_scheduler
from tests.live_server import live_server as serving_scheduler

CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"


def test_what_a_client_asks_is_served_up_to_the_room_and_an_operator_cap():
    default = MaxTokens()
    assert effective_max_tokens(32000, 100, 200_000, default) == 32000  # Claude Code
    assert effective_max_tokens(None, 100, 200_000, default) == default.default  # Codex
    assert effective_max_tokens(None, 100, 8192, default) == 8092  # cut to the room
    assert effective_max_tokens(32000, 100, 8192, default) == 8092
    capped = MaxTokens(cap=4096)
    assert effective_max_tokens(32000, 100, 200_000, capped) == 4096
    assert effective_max_tokens(None, 100, 200_000, MaxTokens(default=512)) == 512


@pytest.mark.slow
async def test_agent_replies_run_past_4096_tokens_by_default(long_context_dir):
    """An agent asking max_tokens 32000 (Claude Code) and one naming no limit (Codex) are
    each served past 4096 tokens, ending only at the context's room, with the length
    reason there. (Messages has no ignore_eos, so the 32000 goes through chat: every
    surface shares `effective_max_tokens`.)"""
    scheduler = start_scheduler(long_context_dir)
    try:
        async with make_client(scheduler) as http:
            chat = await http.post(
                CHAT,
                json={
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 32000,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            )
            responses = await http.post(
                RESPONSES, json={"input": "Hi", "ignore_eos": True, "temperature": 0}
            )
    finally:
        scheduler.stop()
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["total_tokens"] == 8192, chat.json()["usage"]
    assert chat.json()["choices"][0]["finish_reason"] == "length"
    assert responses.status_code == 200, responses.text
    usage = responses.json()["usage"]
    assert usage["input_tokens"] + usage["output_tokens"] == 8192, usage
    assert responses.json()["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_overflow_is_worded_as_the_hosted_apis_word_it(scheduler):
    """litellm's own checkers (the ones its exception mapping runs on a provider's error
    text) recognise each surface's refusal; the Anthropic one carries "prompt is too
    long", what Claude Code compacts on."""
    context = scheduler.model_info.context_length
    words = " ".join(["hello"] * context)
    too_long = [{"role": "user", "content": words}]
    async with make_client(scheduler) as http:
        chat = await http.post(CHAT, json={"messages": too_long})
        completions = await http.post("/v1/completions", json={"prompt": words})
        responses = await http.post(RESPONSES, json={"input": words})
        messages = await http.post(MESSAGES, json={"max_tokens": 5, "messages": too_long})
        fits = await http.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}]})
    for reply in (chat, completions, responses):
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["message"].startswith(f"This model's maximum context length is {context}")
        assert ExceptionCheckers.is_error_str_context_window_exceeded(error["message"])
    assert messages.status_code == 400 and messages.json()["type"] == "error"
    text = messages.json()["error"]["message"]
    assert text.startswith("prompt is too long: ") and text.endswith(f" > {context} maximum")
    assert ExceptionCheckers.is_error_str_context_window_exceeded(text)
    assert fits.status_code == 200, fits.text


async def test_strict_overflow_names_both_counts_in_each_apis_words(scheduler):
    context = scheduler.model_info.context_length
    prompt = [5] * (context - 10)
    async with make_client(scheduler, strict_max_tokens=True) as http:
        completions = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20})
        messages = await http.post(
            MESSAGES,
            json={"max_tokens": context, "messages": [{"role": "user", "content": "Hi"}]},
        )
    error = completions.json()["error"]
    assert completions.status_code == 400 and error["code"] == "context_length_exceeded"
    assert f"you requested {context + 10} tokens ({context - 10} in the messages" in error[
        "message"]  # fmt: skip
    text = messages.json()["error"]["message"]
    assert messages.status_code == 400
    assert text.startswith("input length and `max_tokens` exceed context limit: ")
    assert text.endswith(f" > {context}, decrease input length or `max_tokens` and try again")


@pytest.fixture
def live_server(scheduler):
    """The app on a real 127.0.0.1 port, for the clients that open their own sockets."""
    with serving_scheduler(scheduler) as url:
        yield url


async def test_litellm_and_the_sdks_raise_their_overflow_errors(scheduler, live_server):
    """The real clients: litellm maps both surfaces to ContextWindowExceededError; the
    SDKs raise BadRequestError whose text is the hosted APIs'."""
    context = scheduler.model_info.context_length
    too_long = [{"role": "user", "content": " ".join(["hello"] * context)}]
    with pytest.raises(litellm.ContextWindowExceededError):
        await litellm.acompletion(
            model=f"openai/{MODEL_NAME}",
            api_base=f"{live_server}/v1",
            api_key="none",
            messages=too_long,
            num_retries=0,
        )
    with pytest.raises(litellm.ContextWindowExceededError):
        await litellm.acompletion(
            model=f"anthropic/{MODEL_NAME}",
            api_base=live_server,
            api_key="none",
            messages=too_long,
            max_tokens=5,
            num_retries=0,
        )
    sdk = anthropic.AsyncAnthropic(base_url=live_server, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        await sdk.messages.create(model=MODEL_NAME, max_tokens=5, messages=too_long)
    oai = openai.AsyncOpenAI(base_url=f"{live_server}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await oai.chat.completions.create(model=MODEL_NAME, messages=too_long)
    async with httpx.AsyncClient() as plain:
        assert (await plain.get(f"{live_server}/health")).status_code == 200
