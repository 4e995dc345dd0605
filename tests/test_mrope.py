"""Qwen-VL's 3-D rotary positions (`engines.model.mrope`): a prompt's positions equal
mlx-vlm's own `get_rope_index` for images of different shapes between text, and a
conversation that reuses a cached prefix through its first image, then takes a
different second one, still equals mlx-vlm's `generate`."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engines.model.mrope import prompt_positions
from engines.model.registry import ModelRegistry
from server.image_prompts import PromptImages
from server.images import ImageLimits, image_from_data_url
from server.prompts import render_chat
from tests.conftest import make_client, start_scheduler
from tests.test_vision import answer, mlx_vlm_reference
from tests.vlm_models import FAMILIES, build_qwen2_5_vl, data_url, png


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_prompt_positions_equal_mlx_vlms_rope_index(family, tmp_path):
    registry = ModelRegistry.load(str(FAMILIES[family](tmp_path / family)))
    vision, limits = registry.target.vision, ImageLimits()
    images = PromptImages(vision, limits)
    # a wide image (2x3 grid), then a tall one (a different grid): both shift later text
    wide = images.add(image_from_data_url(data_url(png(1)), limits, "image"), "image")
    tall = images.add(image_from_data_url(data_url(png(2, (90, 60))), limits, "image"), "image")
    content = f"Look: {wide} and then {tall} what now?"
    rendered = render_chat(
        registry.tokenizer, [{"role": "user", "content": content}], images=images
    )
    located = images.locate(rendered.ids)
    assert [image.span.grid for image in located] == [(1, 2, 3), (1, 3, 2)]

    ids = mx.array(rendered.ids)[None]
    grids = mx.array(np.concatenate([i.span.inputs["image_grid_thw"] for i in located]))
    expected, deltas = vision.vlm.language_model.get_rope_index(ids, grids)
    positions = prompt_positions(located)
    assert positions.shift == int(deltas.item()) == -6  # 6 tokens an image, 3 positions
    ours = positions.at(0, len(rendered.ids) + 5)  # the prompt and five tokens after it
    assert np.array_equal(ours[:, : len(rendered.ids)], np.array(expected[:, 0]))
    after = np.arange(len(rendered.ids), len(rendered.ids) + 5) + positions.shift
    assert np.array_equal(ours[:, len(rendered.ids) :], np.broadcast_to(after, (3, 5)))


TEXT = "Once upon a time there was a dog. Then"


def images_and_text(*images: bytes) -> list[dict]:
    """One user turn: the first image, the text, then each later image and "and"."""
    content = [{"type": "image_url", "image_url": {"url": data_url(images[0])}}]
    content.append({"type": "text", "text": TEXT})
    for image in images[1:]:
        content.append({"type": "image_url", "image_url": {"url": data_url(image)}})
        content.append({"type": "text", "text": "and"})
    return [{"role": "user", "content": content}]


def as_mlx_vlm(messages: list[dict]) -> list[dict]:
    """The same turn as mlx-vlm's template takes it (image parts without data)."""
    parts = [
        {"type": "image"} if part["type"] == "image_url" else part
        for part in messages[0]["content"]
    ]
    return [{"role": "user", "content": parts}]


async def test_a_prefix_through_one_image_serves_the_turn_that_adds_another(qwen_dir):
    """An agent's next turn adds a screenshot: the prompt with image A is cached, and
    [A, C] starts from its entry, whose keys were rotated at A's positions; C's
    positions, and the text after it, are the new prompt's own."""
    reference = mlx_vlm_reference(qwen_dir)
    scheduler = start_scheduler(qwen_dir)
    one, two = images_and_text(png(1)), images_and_text(png(1), png(3, (90, 60)))
    try:
        async with make_client(scheduler) as client:
            body = {"max_tokens": 12, "temperature": 0}
            first = await client.post("/v1/chat/completions", json={**body, "messages": one})
            second = await client.post("/v1/chat/completions", json={**body, "messages": two})
    finally:
        scheduler.stop()
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 14  # through the first image and the text after it
    assert answer(first) == reference([png(1)], "", 12, messages=as_mlx_vlm(one))
    assert answer(second) == reference([png(1), png(3, (90, 60))], "", 12, messages=as_mlx_vlm(two))


def test_a_text_prompt_packed_beside_an_image_row_keeps_its_positions(qwen_dir):
    """While an image request decodes (its positions shifted by its image), a long text
    prompt prefills in chunks packed into the rows' forward (`packed_forward`, which
    rotates each part at its rows' own positions): both stay mlx-vlm's."""
    from engines.batched.engine import BatchedSpeculativeEngine
    from engines.batched.packed_forward import supports_packing
    from engines.request import GenerationRequest
    from engines.sequence import make_sequence
    from engines.single.engine import SpeculativeEngine
    from engines.spec_config import SpecConfig
    from tests.test_batched_speculation import COST, GREEDY
    from tests.test_vision_pacing import image_request

    registry = ModelRegistry.load(str(qwen_dir))
    assert supports_packing(registry.target.model)
    spec = SpeculativeEngine(registry, SpecConfig(enable_pld=False), cost=COST)
    engine = BatchedSpeculativeEngine(registry, spec.speculation, prefill_step_size=16)
    registry.transfer(engine.name)
    story = "The little dog ran to the park and played with a red ball all day. " * 6
    ids = registry.tokenizer.apply_chat_template(
        [{"role": "user", "content": story}], add_generation_prompt=True
    )
    texts = {"image": "", "text": ""}
    engine.admit(make_sequence(image_request(registry, "image", 5, 40), registry.tokenizer))
    for _ in range(4):  # its prompt in, decoding
        for output in engine.step().outputs:
            texts[output.request_id] += output.text
    text = GenerationRequest("text", tuple(ids), 12, GREEDY)
    engine.admit(make_sequence(text, registry.tokenizer))
    while engine.batch_size:
        for output in engine.step().outputs:
            texts[output.request_id] += output.text
    reference = mlx_vlm_reference(qwen_dir)
    assert texts["image"] == reference([png(5)], "Once upon a time", 40)
    assert texts["text"] == reference([], story, 12)
