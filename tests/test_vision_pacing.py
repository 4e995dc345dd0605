"""Images beside the rest of the engines: a new image's vision tower runs a layer per
batched step before its prompt chunk (`engines.prompt_images.advance_towers`) while
the batch's other rows decode (the same lazy graph, evaluated in steps, gives the
same bits); a drafter fed the target's hidden states drafts for image prompts."""

from __future__ import annotations

import pytest

from engines.batched.engine import BatchedSpeculativeEngine
from engines.batched.packed_forward import supports_packing
from engines.model.demo_qwen_vl import build_qwen3_5 as build_qwen35
from engines.model.demo_qwen_vl import build_qwen3_vl as build_qwen3
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest
from engines.sequence import make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from server.image_prompts import PromptImages
from server.images import ImageLimits, image_from_data_url
from server.prompts import render_chat
from tests.test_batched_speculation import COST, GREEDY
from tests.test_vision import mlx_vlm_reference
from tests.vlm_models import SHARED, build_idefics3, build_qwen2_5_vl, data_url, png

LAYERS = 4  # the tower's depth here: 4 layers, then the projector and merge
# (builder, the tower setting that gives it LAYERS layers): SigLIP's encoder layers,
# Qwen-VL's blocks
TOWERS = {
    "idefics3": lambda out: build_idefics3(out, vision={"num_hidden_layers": LAYERS}),
    "qwen2_5_vl": lambda out: build_qwen2_5_vl(
        out, vision={"depth": LAYERS, "fullatt_block_indexes": [LAYERS - 1]}
    ),
    # deepstack features taken after its first block, as lazily as the rest
    "qwen3_vl": lambda out: build_qwen3(out, SHARED, vision={"depth": LAYERS}),
    # Qwen3.5: the same tower without deepstack, beside gated-delta layers (seed 1:
    # the first request's answer outlasts the late one's tower)
    "qwen3_5": lambda out: build_qwen35(out, SHARED, seed=1, vision={"depth": LAYERS}),
}
PROMPT = "Once upon a time"


def image_request(registry: ModelRegistry, rid: str, seed: int | tuple, max_tokens: int):
    """A greedy request whose one user turn is the image of `seed` (or the images of
    each seed in a tuple), then the prompt."""
    limits = ImageLimits()
    images = PromptImages(registry.target.vision, limits)
    stand_ins = [
        images.add(image_from_data_url(data_url(png(one)), limits, "image"), "image")
        for one in (seed if isinstance(seed, tuple) else (seed,))
    ]
    messages = [{"role": "user", "content": "".join(stand_ins) + PROMPT}]
    rendered = render_chat(registry.tokenizer, messages, images=images)
    located = images.locate(rendered.ids)
    return GenerationRequest(rid, tuple(rendered.ids), max_tokens, GREEDY, images=located)


def count_tower_steps(monkeypatch) -> list[int]:
    """Tower evaluations (`TowerStages.advance`) per engine step, counted into the
    list's last entry: the caller appends a 0 before each step."""
    from engines.model.vision import TowerStages

    advanced, advance = [], TowerStages.advance

    def counted_advance(self):
        advanced[-1] += 1
        return advance(self)

    monkeypatch.setattr(TowerStages, "advance", counted_advance)
    return advanced


@pytest.mark.parametrize("family", sorted(TOWERS))
def test_a_new_images_tower_runs_a_layer_a_step_while_the_batch_decodes(tmp_path, family):
    model_dir = TOWERS[family](tmp_path / "vlm")
    registry = ModelRegistry.load(str(model_dir))
    spec = SpeculativeEngine(registry, SpecConfig(enable_pld=False), cost=COST)
    engine = BatchedSpeculativeEngine(registry, spec.speculation, prefill_step_size=64)
    registry.transfer(engine.name)
    first = image_request(registry, "first", 27, 24)
    late = image_request(registry, "late", 28, 12)
    outputs: dict[str, list] = {"first": [], "late": []}

    def step() -> set[str]:
        result = engine.step()
        for output in result.outputs:
            outputs[output.request_id].append(output)
        return {output.request_id for output in result.outputs if output.token_ids}

    engine.admit(make_sequence(first, registry.tokenizer))
    for _ in range(6):  # the first one's prompt in, decoding
        step()
    late_seq = make_sequence(late, registry.tokenizer)
    engine.admit(late_seq)
    staged = []  # at each step the late image's tower was still running: who decoded
    while engine.batch_size:
        emitted = step()
        if late_seq.image_stage is not None:
            staged.append(emitted)
    # a step a layer at least (the engine also takes plain decode steps between);
    # where prefill packs into the rows' forward, decoding went on at all of them but
    # the first, a prefill step of its own as a text prompt's first chunk is; where it
    # cannot (Qwen3's blocks), prefill steps alternate with decode steps, as for text
    assert len(staged) >= LAYERS, staged
    decoded = sum("first" in emitted for emitted in staged)
    packs = supports_packing(registry.target.model)
    assert decoded >= (len(staged) - 1 if packs else len(staged) // 2), staged
    reference = mlx_vlm_reference(model_dir)
    for request_id, seed, max_tokens in (("first", 27, 24), ("late", 28, 12)):
        text = "".join(o.text for o in outputs[request_id])
        assert text == reference([png(seed)], PROMPT, max_tokens)


@pytest.mark.parametrize("build", [build_idefics3, build_qwen2_5_vl], ids=["idefics3", "qwen"])
async def test_a_hidden_state_drafter_leaves_image_prompts_exact(tmp_path, build):
    """An EAGLE-3 speculator reads the target's hidden states, the image rows' too (the
    taps see the forward fed input embeddings): it drafts for image requests alone and
    in the batch, beside a text request, and greedy output stays mlx-vlm's."""
    import asyncio

    from bench.drafter_checkpoints import write_eagle3
    from tests.conftest import make_client, start_scheduler
    from tests.test_vision import answer, chat_body

    model_dir = build(tmp_path / "vlm")
    drafter = write_eagle3(tmp_path / "eagle3", model_dir, aux_ids=[0, 1, 1], draft_vocab=0)
    scheduler = start_scheduler(
        model_dir, draft_model=str(drafter), draft_kind="eagle3", prefix_cache_entries=0
    )
    try:
        async with make_client(scheduler) as client:
            alone = await client.post("/v1/chat/completions", json=chat_body([png(29)]))
            together = await asyncio.gather(
                client.post("/v1/chat/completions", json=chat_body([png(30)])),
                client.post("/v1/chat/completions", json=chat_body([], "The little dog")),
            )
    finally:
        scheduler.stop()
    reference = mlx_vlm_reference(model_dir)
    assert answer(alone) == reference([png(29)], PROMPT, 12)
    assert answer(together[0]) == reference([png(30)], PROMPT, 12)
    assert answer(together[1]) == reference([], "The little dog", 12)
    drafted = [r.json()["speculation"]["draft_tokens"] for r in (alone, *together)]
    assert all(count > 0 for count in drafted), drafted  # it drafted for every one


def test_a_step_runs_one_tower_layer_of_one_bounded_batch(tmp_path, monkeypatch):
    """Two requests of two images each arrive together beside a decoding one, with
    --max-tower-pixels at one image: each image is its own tower batch, and no step
    runs more than one tower layer (before, each arriving row advanced its own tower
    in the same step, all its images at once)."""
    model_dir = TOWERS["idefics3"](tmp_path / "vlm")
    registry = ModelRegistry.load(str(model_dir))
    vision = registry.target.vision
    spec = SpeculativeEngine(registry, SpecConfig(enable_pld=False), cost=COST)
    engine = BatchedSpeculativeEngine(registry, spec.speculation, prefill_step_size=64)
    registry.transfer(engine.name)
    first = image_request(registry, "first", 27, 40)
    pairs = {"two": (31, 32), "three": (33, 34)}
    requests = [image_request(registry, rid, seeds, 8) for rid, seeds in pairs.items()]
    vision.tower_pixels = requests[0].images[0].span.inputs["pixel_values"].size // 3
    texts = {"first": "", "two": "", "three": ""}
    batches, stage = [], vision.stage
    advanced = count_tower_steps(monkeypatch)

    def counted_stage(spans):
        batches.append(len(spans))
        return stage(spans)

    vision.stage = counted_stage
    engine.admit(make_sequence(first, registry.tokenizer))
    for _ in range(6):
        advanced.append(0)
        for output in engine.step().outputs:
            texts[output.request_id] += output.text
    for request in requests:
        engine.admit(make_sequence(request, registry.tokenizer))
    while engine.batch_size:
        advanced.append(0)
        for output in engine.step().outputs:
            texts[output.request_id] += output.text
    assert batches == [1, 1, 1, 1, 1]  # the first request's image, then one per image
    assert max(advanced) == 1, advanced  # one tower layer (or merge) a step
    assert sum(advanced) == 5 * (LAYERS + 1)
    reference = mlx_vlm_reference(model_dir)
    assert texts["first"] == reference([png(27)], PROMPT, 40)
    assert all(texts[rid] for rid in pairs), texts  # served, images encoded apart


def test_the_tower_bound_comes_from_the_serve_flag(tmp_path):
    from server.cli import build_parser
    from server.serve import build_config
    from tests.conftest import start_scheduler

    model_dir = build_idefics3(tmp_path / "vlm")
    args = build_parser().parse_args(["serve", str(model_dir), "--max-tower-pixels", "1234"])
    config = build_config(args).scheduler
    assert config.max_tower_pixels == 1234
    scheduler = start_scheduler(model_dir, max_tower_pixels=config.max_tower_pixels)
    try:
        assert scheduler.registry.target.vision.tower_pixels == 1234
    finally:
        scheduler.stop()


def test_alone_an_images_tower_also_runs_a_layer_a_step(tmp_path, monkeypatch):
    """The single-stream engine stages the tower too: each step runs one layer, so a
    request arriving meanwhile waits for a layer, not the whole tower, before the
    scheduler batches it."""
    model_dir = TOWERS["idefics3"](tmp_path / "vlm")
    registry = ModelRegistry.load(str(model_dir))
    engine = SpeculativeEngine(registry, SpecConfig(enable_pld=False), cost=COST)
    registry.transfer(engine.name)
    engine.admit(make_sequence(image_request(registry, "alone", 35, 12), registry.tokenizer))
    advanced, text = count_tower_steps(monkeypatch), ""
    while engine.active is not None:
        advanced.append(0)
        text += "".join(output.text for output in engine.step().outputs)
    assert sum(advanced) == LAYERS + 1 and max(advanced) == 1, advanced
    assert text == mlx_vlm_reference(model_dir)([png(35)], PROMPT, 12)


def test_qwen3_vl_deepstack_is_staged_not_evaluated_up_front(tmp_path):
    """mlx-vlm's Qwen3-VL embedding evaluates its deepstack features itself, which
    would run the tower up to the last deepstack block at once (block 24 of 27 on the
    real models); Tandem builds the same embeddings lazily, so `stage` evaluates
    nothing and each step runs one block."""
    import mlx.core as mx

    model_dir = build_qwen3(
        tmp_path / "qwen3", SHARED, vision={"depth": LAYERS, "deepstack_visual_indexes": [2]}
    )
    registry = ModelRegistry.load(str(model_dir))
    request = image_request(registry, "deep", 36, 4)
    evaluated, evaluate = [], mx.eval

    def counted_eval(*arrays):
        evaluated.append(len(arrays))
        return evaluate(*arrays)

    mx.eval = counted_eval
    try:
        stages = registry.target.vision.stage([image.span for image in request.images])
    finally:
        mx.eval = evaluate
    assert evaluated == []
    steps = 0
    while not stages.ready:
        stages.advance()
        steps += 1
    assert steps == LAYERS + 1
