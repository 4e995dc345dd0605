"""Images reach a vision-language model on every surface, through the same engines as
text: greedy output equals mlx-vlm's own `generate` for the same images and prompt,
alone, in a batch beside a text-only request and another image, across migrations
between the engines, and from a prefix-cache entry of the same image (never of a
different one). Bad images are a 400 that harms no other request."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
from pathlib import Path
from unittest import mock

import pytest

from tests.conftest import MODEL_NAME, make_client, start_scheduler
from tests.vlm_models import FAMILIES, build_idefics3, data_url, png

PROMPT = "Once upon a time"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def vlm_dir(request, tmp_path_factory) -> Path:
    """Each family served: Idefics3 (SmolVLM's), Gemma-3 (windowed layers)."""
    return FAMILIES[request.param](tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def vlm_reference(vlm_dir):
    return mlx_vlm_reference(vlm_dir)


def mlx_vlm_reference(vlm_dir: Path):
    """mlx-vlm's own greedy generation: messages (with image parts) -> text."""
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.generate import generate
    from mlx_vlm.utils import load
    from PIL import Image

    model, processor = load(str(vlm_dir))
    tokenizer = load_tokenizer(vlm_dir)
    stops = {*tokenizer.eos_token_ids, *getattr(processor, "additional_eos_token_ids", ())}
    eos = json.loads((vlm_dir / "config.json").read_text()).get("eos_token_id", [])
    stops |= {eos} if isinstance(eos, int) else set(eos)  # where mlx-vlm stops too

    def run(
        images: list[bytes], text: str, max_tokens: int, before: str = "", messages=None
    ) -> str:
        content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
        if before:  # text ahead of the images
            content.insert(0, {"type": "text", "text": before})
        messages = messages or [{"role": "user", "content": content}]
        prompt = processor.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        pil = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
        with token_by_token_recurrence():
            result = generate(
                model,
                processor,
                prompt,
                image=pil or None,
                max_tokens=max_tokens,
                temperature=0.0,
                verbose=False,
            )
        # as the server's detokenizer writes those tokens (mlx-vlm's own text drops
        # incomplete byte sequences that a random model emits)
        detokenizer = tokenizer.detokenizer
        for token in result.token_ids:
            if token not in stops:
                detokenizer.add_token(token)
        detokenizer.finalize()
        return detokenizer.text

    return run


@contextlib.contextmanager
def token_by_token_recurrence():
    """mlx-vlm's Qwen3.5 computing its gated-delta recurrence token by token, as it
    does on Metal (and as mlx-lm does everywhere). Without Metal it prefills with a
    chunked parallel scan instead, whose rounding depends on where its prefill chunks
    begin -- a reference no server chunking its prompts differently could match."""
    from mlx_vlm.models.qwen3_5 import gated_delta

    def sequential(q, k, v, g, beta, state, mask=None, C=64):
        return gated_delta.gated_delta_ops(q, k, v, g, beta, state, mask)

    with mock.patch.object(gated_delta, "gated_delta_chunked", sequential):
        yield


@pytest.fixture(scope="module")
def vlm_scheduler(vlm_dir):
    scheduler = start_scheduler(vlm_dir)
    yield scheduler
    scheduler.stop()


def chat_body(images: list[bytes], text: str = PROMPT, max_tokens: int = 12) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    content = [*parts, {"type": "text", "text": text}]
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def anthropic_image(image: bytes, media_type: str = "image/png") -> dict:
    """An Anthropic image block with `image` as base64."""
    data = base64.b64encode(image).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def answer(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


async def test_an_image_reaches_the_model_as_mlx_vlm_reads_it(vlm_scheduler, vlm_reference):
    async with make_client(vlm_scheduler) as client:
        first = answer(await client.post("/v1/chat/completions", json=chat_body([png(1)])))
        other = answer(await client.post("/v1/chat/completions", json=chat_body([png(2)])))
        models = (await client.get("/v1/models")).json()["data"][0]
        page = (await client.get("/ui/status")).json()
    assert first == vlm_reference([png(1)], PROMPT, 12)
    assert other == vlm_reference([png(2)], PROMPT, 12)
    assert first != other  # the pixels, not just the tokens, reach the model
    assert models["capabilities"]["vision"] is True
    assert page["vision"] is True  # the web page says so


async def test_images_batched_beside_text_and_each_other(vlm_dir, vlm_reference):
    scheduler = start_scheduler(vlm_dir, prefix_cache_entries=0)
    try:
        async with make_client(scheduler) as client:
            bodies = [chat_body([png(3)], max_tokens=16), chat_body([png(4)], max_tokens=16)]
            bodies.append(chat_body([], "The little dog", max_tokens=16))
            bodies.append(chat_body([png(5), png(6)], "Two pictures", max_tokens=16))
            replies = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for body in bodies)
            )
        assert scheduler.batched_engine is not None  # they ran as a batch
    finally:
        scheduler.stop()
    texts = [answer(r) for r in replies]
    assert texts[0] == vlm_reference([png(3)], PROMPT, 16)
    assert texts[1] == vlm_reference([png(4)], PROMPT, 16)
    assert texts[2] == vlm_reference([], "The little dog", 16)
    assert texts[3] == vlm_reference([png(5), png(6)], "Two pictures", 16)


async def test_migration_both_ways_keeps_an_image_request_exact(vlm_dir, vlm_reference):
    """A long image request starts alone (single-stream engine), moves into the batch
    when a second request comes, and back out when that one is done."""
    scheduler = start_scheduler(vlm_dir, batch_return_steps=2)
    try:
        async with make_client(scheduler) as client:
            long = asyncio.create_task(
                client.post("/v1/chat/completions", json=chat_body([png(9)], max_tokens=1500))
            )
            # decoding alone by now (an image whose answer runs long: no early EOS)
            while scheduler.registry.tokens_processed < 200 and not long.done():
                await asyncio.sleep(0.01)
            short = await client.post(
                "/v1/chat/completions", json=chat_body([png(8)], "Hi", max_tokens=4)
            )
            reply = await long
        moves = dict(scheduler.counters.mode_switches)
    finally:
        scheduler.stop()
    assert reply.json()["usage"]["completion_tokens"] > 400  # it outlived the short one
    assert answer(reply) == vlm_reference([png(9)], PROMPT, 1500)
    assert answer(short) == vlm_reference([png(8)], "Hi", 4)
    assert moves.get(("speculative", "batched"), 0) >= 1  # into the batch
    assert moves.get(("batched", "speculative"), 0) >= 1  # and back out


async def test_prefix_cache_serves_the_same_image_never_another(vlm_dir, vlm_reference):
    scheduler = start_scheduler(vlm_dir)
    try:
        async with make_client(scheduler) as client:
            first = await client.post("/v1/chat/completions", json=chat_body([png(9)]))
            again = await client.post("/v1/chat/completions", json=chat_body([png(9)]))
            other = await client.post("/v1/chat/completions", json=chat_body([png(10)]))
    finally:
        scheduler.stop()
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (again, other)]
    prompt_tokens = again.json()["usage"]["prompt_tokens"]
    assert cached[0] >= prompt_tokens - 2  # everything but the newest tokens
    assert cached[1] <= 4  # BOS and the role marker: the image is not reused
    assert answer(first) == answer(again) == vlm_reference([png(9)], PROMPT, 12)
    assert answer(other) == vlm_reference([png(10)], PROMPT, 12)


async def test_a_first_image_after_a_text_conversation_reuses_the_text(vlm_dir, vlm_reference):
    """An agent's conversation was cached without images; its next turn adds a
    screenshot: the agent's instructions before it are served from the text-only
    entry (a hybrid model's from the checkpoint kept where its system prompt ends)."""
    scheduler = start_scheduler(vlm_dir)
    history = "The little dog ran to the park and played with a red ball all day. " * 4
    system = {"role": "system", "content": history}
    try:
        async with make_client(scheduler) as client:
            text_only = chat_body([], "Hi", max_tokens=8)
            text_only["messages"].insert(0, system)
            await client.post("/v1/chat/completions", json=text_only)
            body = chat_body([png(21)], max_tokens=8)
            body["messages"].insert(0, system)
            reply = await client.post("/v1/chat/completions", json=body)
    finally:
        scheduler.stop()
    usage = reply.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert 40 < cached < usage["prompt_tokens"] - 5  # the instructions' tokens, before the image
    content = [{"type": "image"}, {"type": "text", "text": PROMPT}]
    messages = [system, {"role": "user", "content": content}]
    assert answer(reply) == vlm_reference([png(21)], PROMPT, 8, messages=messages)


async def test_anthropic_and_responses_surfaces_carry_images(vlm_scheduler, vlm_reference):
    image = png(11)
    anthropic_body = {
        "model": MODEL_NAME,
        "max_tokens": 12,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    anthropic_image(image),
                    {"type": "text", "text": PROMPT},
                ],
            }
        ],
    }
    responses_body = {
        "max_output_tokens": 12,
        "temperature": 0,
        "input": responses_input(image),
    }
    async with make_client(vlm_scheduler) as client:
        message = await client.post("/v1/messages", json=anthropic_body)
        counted = await client.post("/v1/messages/count_tokens", json=anthropic_body)
        response = await client.post("/v1/responses", json=responses_body)
    expected = vlm_reference([image], PROMPT, 12)
    assert message.status_code == 200, message.text
    assert message.json()["content"][0]["text"] == expected
    assert counted.json()["input_tokens"] == message.json()["usage"]["input_tokens"]
    assert response.status_code == 200, response.text
    assert response.json()["output"][0]["content"][0]["text"] == expected


async def test_a_responses_follow_up_still_sees_the_earlier_image(vlm_scheduler, vlm_reference):
    """Turn two names turn one by previous_response_id and sends only text: the
    stored conversation brings its image back, so the model still reads it. (Turn
    one's answer is held to a schema: a random model's free text holds image tokens
    and broken bytes that would not read back as the same tokens.)"""
    image, follow_up = png(22), "And then the dog"
    answer_schema = {"type": "string", "enum": ["The dog ran home."]}
    first_body = {
        "max_output_tokens": 16,
        "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": answer_schema}},
        "input": responses_input(image),
    }
    async with make_client(vlm_scheduler) as client:
        first = await client.post("/v1/responses", json=first_body)
        assert first.status_code == 200, first.text
        second = await client.post(
            "/v1/responses",
            json={
                "max_output_tokens": 10,
                "temperature": 0,
                "previous_response_id": first.json()["id"],
                "input": follow_up,
            },
        )
    assert second.status_code == 200, second.text
    reply = first.json()["output"][0]["content"][0]["text"]
    assert reply == '"The dog ran home."'
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]},
        {"role": "assistant", "content": [{"type": "text", "text": reply}]},
        {"role": "user", "content": [{"type": "text", "text": follow_up}]},
    ]
    expected = vlm_reference([image], "", 10, messages=messages)
    assert second.json()["output"][0]["content"][0]["text"] == expected
    cached = second.json()["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached > 4  # turn one's prompt, its image included, from the prefix cache


def responses_input(image: bytes) -> list[dict]:
    """A Responses user turn: the image, then the prompt."""
    content = [
        {"type": "input_image", "image_url": data_url(image)},
        {"type": "input_text", "text": PROMPT},
    ]
    return [{"role": "user", "content": content}]


def truncated_png() -> bytes:
    data = png(12)
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    "url, names",
    [
        (data_url(truncated_png()), "decoded"),
        (data_url(png(13, (1, 1))), "1x1"),
        (data_url(png(14), "image/jpeg"), "image/png"),
        ("https://example.com/cat.png", "--allow-image-urls"),
    ],
    ids=["truncated", "1x1", "wrong-media-type", "url-when-off"],
)
async def test_bad_images_are_a_400_and_harm_no_one(vlm_scheduler, vlm_reference, url, names):
    bad = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": PROMPT},
                ],
            }
        ],
        "max_tokens": 4,
    }
    async with make_client(vlm_scheduler) as client:
        good = asyncio.create_task(
            client.post("/v1/chat/completions", json=chat_body([png(15)], max_tokens=12))
        )
        refused = await client.post("/v1/chat/completions", json=bad)
        served = await good
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert names in error["message"]
    assert error["param"].startswith("messages[0].content[0]")
    assert answer(served) == vlm_reference([png(15)], PROMPT, 12)


def test_the_sdks_send_images_that_reach_the_model(vlm_scheduler, vlm_reference):
    """The OpenAI SDK with a data URL and the Anthropic SDK with a base64 screenshot,
    over a real socket: each reply is what mlx-vlm writes for that image."""
    import anthropic
    import openai

    from tests.live_server import live_server

    image = png(16)
    with live_server(vlm_scheduler) as url:
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        completion = chat.chat.completions.create(
            model=MODEL_NAME,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(image)}},
                        {"type": "text", "text": PROMPT},
                    ],
                }
            ],
            max_tokens=12,
            temperature=0,
        )
        messages = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        message = messages.messages.create(
            model=MODEL_NAME,
            max_tokens=12,
            extra_body={"temperature": 0},  # this SDK version no longer takes it
            messages=[
                {
                    "role": "user",
                    "content": [
                        anthropic_image(image),
                        {"type": "text", "text": PROMPT},
                    ],
                }
            ],
        )
        with pytest.raises(anthropic.BadRequestError) as refused:
            messages.messages.create(
                model=MODEL_NAME,
                max_tokens=4,
                messages=[
                    {
                        "role": "user",
                        "content": [anthropic_image(image, "image/jpeg")],
                    }
                ],
            )
    expected = vlm_reference([image], PROMPT, 12)
    assert completion.choices[0].message.content == expected
    assert message.content[0].text == expected
    assert "image/png" in str(refused.value)  # the SDK shows what was wrong


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory) -> Path:
    return build_idefics3(tmp_path_factory.mktemp("idefics3-one"))


async def test_the_same_image_after_a_restart_comes_from_disk(idefics3_dir, tmp_path):
    """The disk tier keys entries by the images' digests too: after a restart the same
    screenshot is served from disk, and the next turn, with a new screenshot, is served
    from disk up to that image."""
    history = "The little dog ran to the park and played with a red ball all day. " * 12
    disk = {"prefix_cache_dir": str(tmp_path / "prefix"), "prefix_cache_disk_bytes": 1 << 30}

    def body(seed: int) -> dict:
        request = chat_body([png(seed)], max_tokens=8)
        content = [{"type": "text", "text": history}, *request["messages"][0]["content"]]
        request["messages"][0]["content"] = content
        return request

    async def serve_bodies(bodies: list[dict]) -> list:
        """A server over the disk tier that answers `bodies` in turn, then stops."""
        scheduler = start_scheduler(idefics3_dir, **disk)
        assert scheduler._prefix.disk.wait_ready(60)
        try:
            async with make_client(scheduler) as client:
                return [await client.post("/v1/chat/completions", json=b) for b in bodies]
        finally:
            scheduler.stop()

    async def serve(*seeds: int) -> list:
        return await serve_bodies([body(seed) for seed in seeds])

    (first,) = await serve(22)
    reference = mlx_vlm_reference(idefics3_dir)
    said = answer(first)
    # the next turn: the same conversation, the model's answer, and a new screenshot
    turn = body(22)
    turn["messages"] += [
        {"role": "assistant", "content": said},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(23))}},
                                     {"type": "text", "text": "And this one?"}]},
    ]  # fmt: skip
    again, later = await serve_bodies([body(22), turn])
    usage = [r.json()["usage"] for r in (first, again, later)]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    assert usage[0]["prompt_tokens"] > 256  # long enough for the disk tier
    assert cached[0] == 0 and cached[1] >= usage[1]["prompt_tokens"] - 2
    # the new turn: everything up to its new image, read back from disk
    assert usage[0]["prompt_tokens"] < cached[2] < usage[2]["prompt_tokens"] - 10
    assert said == answer(again) == reference([png(22)], PROMPT, 8, before=history)
    parts = [{"type": "text", "text": history}, {"type": "image"}, {"type": "text", "text": PROMPT}]
    conversation = [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [{"type": "text", "text": said}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]},
    ]
    expected = reference([png(22), png(23)], "", 8, messages=conversation)
    assert answer(later) == expected


async def test_an_allowed_image_url_is_fetched_and_read(idefics3_dir):
    """`--allow-image-urls 127.0.0.1`: an image URL on that host is fetched (a real
    http.server here) and reaches the model; another host is refused by name."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from server.images import ImageLimits

    image = png(24)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(image)))
            self.end_headers()
            self.wfile.write(image)

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/shot.png"
    scheduler = start_scheduler(idefics3_dir)
    limits = ImageLimits(url_hosts=("127.0.0.1",))
    try:
        async with make_client(scheduler, image_limits=limits) as client:
            body = chat_body([image])
            body["messages"][0]["content"][0]["image_url"]["url"] = url
            fetched = await client.post("/v1/chat/completions", json=body)
            body["messages"][0]["content"][0]["image_url"]["url"] = "http://example.com/a.png"
            refused = await client.post("/v1/chat/completions", json=body)
    finally:
        scheduler.stop()
        httpd.shutdown()
        thread.join()
    assert answer(fetched) == mlx_vlm_reference(idefics3_dir)([image], PROMPT, 12)
    assert refused.status_code == 400 and "example.com" in refused.json()["error"]["message"]


async def test_the_same_image_prompt_sent_twice_at_once_is_prefilled_once(idefics3_dir):
    """A prefill follower: the second of two identical image prompts of one key waits
    for the first's prefill (chunks of 16 tokens, so it stops inside the image) and
    starts from it; a different image never does."""
    history = "The little dog ran to the park and played with a red ball all day. " * 3
    scheduler = start_scheduler(
        idefics3_dir, prefill_step_size=16, prefill_follow_min_tokens=20, suffix_tokens_per_key=0
    )

    def body(seed: int) -> dict:
        request = chat_body([png(seed)], max_tokens=8)
        content = [{"type": "text", "text": history}, *request["messages"][0]["content"]]
        request["messages"][0]["content"] = content
        return request

    try:
        async with make_client(scheduler) as client:
            replies = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body(s)) for s in (25, 25, 26))
            )
        follows = dict(scheduler.counters.prefill_follows)
    finally:
        scheduler.stop()
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    prompt_tokens = replies[1].json()["usage"]["prompt_tokens"]
    reference = mlx_vlm_reference(idefics3_dir)
    expected = [reference([png(s)], PROMPT, 8, before=history) for s in (25, 25, 26)]
    assert [answer(r) for r in replies] == expected
    # whichever of the two came second followed the other's prefill
    assert max(cached[:2]) >= prompt_tokens - 2 and sum(follows.values()) >= 1, (cached, follows)
    assert cached[2] < prompt_tokens - 10  # the history at most, never the other image


async def test_small_chunks_never_split_an_image_that_attends_both_ways(tmp_path):
    """Gemma-4's image tokens attend to each other both ways, so an image must be
    inside one forward: with prompt chunks of 16 tokens (an image is ~60), alone and
    in the batch, each chunk still takes an image whole, and output stays mlx-vlm's."""
    from tests.vlm_models import build_gemma4

    vlm_dir = build_gemma4(tmp_path / "gemma4")
    reference = mlx_vlm_reference(vlm_dir)
    scheduler = start_scheduler(
        vlm_dir, prefill_step_size=16, batch_prefill_step_size=16, prefix_cache_entries=0
    )
    try:
        async with make_client(scheduler) as client:
            alone = await client.post("/v1/chat/completions", json=chat_body([png(23)]))
            together = await asyncio.gather(
                client.post("/v1/chat/completions", json=chat_body([png(24), png(25)])),
                client.post("/v1/chat/completions", json=chat_body([png(26)])),
            )
    finally:
        scheduler.stop()
    assert answer(alone) == reference([png(23)], PROMPT, 12)
    assert answer(together[0]) == reference([png(24), png(25)], PROMPT, 12)
    assert answer(together[1]) == reference([png(26)], PROMPT, 12)


async def test_a_quantized_qwen3_5_moe_keeps_its_8_bit_gates(tmp_path):
    """mlx-vlm's own 4-bit conversion of Qwen3.5-MoE keeps its routers' gates at 8
    bits (per-layer settings in the config): the language half is quantized layer by
    layer as the checkpoint says, loads, and reads an image as mlx-vlm does."""
    from mlx_vlm.convert import convert

    from tests.vlm_models import build_qwen3_5_moe

    source = build_qwen3_5_moe(tmp_path / "source")
    quantized = tmp_path / "quantized"
    convert(str(source), str(quantized), quantize=True, q_group_size=32, q_bits=4)
    settings = json.loads((quantized / "config.json").read_text())["quantization"]
    assert settings["language_model.model.layers.0.mlp.gate"]["bits"] == 8
    scheduler = start_scheduler(quantized)
    try:
        async with make_client(scheduler) as client:
            reply = await client.post("/v1/chat/completions", json=chat_body([png(3)]))
    finally:
        scheduler.stop()
    assert answer(reply) == mlx_vlm_reference(quantized)([png(3)], PROMPT, 12)
