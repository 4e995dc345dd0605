"""The real pretrained TinyStories model from ../shared/models, when present."""

from __future__ import annotations

import pytest
from mlx_lm import generate, load

from tests.conftest import SHARED_MODELS, make_client, start_scheduler

STORIES = SHARED_MODELS / "stories260K"

pytestmark = pytest.mark.skipif(not STORIES.exists(), reason="../shared/models not present")


@pytest.fixture(scope="module")
def stories_scheduler():
    scheduler = start_scheduler(STORIES)
    yield scheduler
    scheduler.stop()


@pytest.mark.parametrize("prompt", ["Once upon a time", "Lily and Ben went to the park."])
async def test_greedy_completion_equals_mlx_lm_generate(stories_scheduler, prompt):
    model, tokenizer = load(str(STORIES))
    expected = generate(model, tokenizer, prompt, max_tokens=120)
    assert len(expected) > 200, "real model should produce a story"
    async with make_client(stories_scheduler) as client:
        response = await client.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": 120, "temperature": 0},
        )
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == expected


SALTY = SHARED_MODELS / "tinystories-280K-saltyduckegg"
STORY_PROMPTS = [
    "Once upon a time",
    "Tom had a red ball. He liked to play with it every day.",
    "The bird was very happy. The bird was very happy. The bird",
]


@pytest.fixture(scope="module")
def stories_spec_engine():
    from engines.gating.measured_costs import CostModel
    from engines.model.registry import ModelRegistry
    from engines.single.engine import SpeculativeEngine
    from engines.spec_config import SpecConfig

    registry = ModelRegistry.load(str(STORIES), str(SALTY))
    engine = SpeculativeEngine(registry, SpecConfig(num_draft_tokens=4), CostModel.assumed(9))
    registry.transfer(engine.name)
    return engine


@pytest.mark.parametrize("prompt", STORY_PROMPTS)
def test_real_draft_pair_greedy_equals_plain_with_acceptance(stories_spec_engine, prompt):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from engines.request import GenerationRequest, SamplingParams
    from engines.sequence import make_sequence

    engine = stories_spec_engine
    tokenizer = engine.registry.tokenizer
    prompt_ids = tokenizer.encode(prompt)
    request = GenerationRequest(
        "r", tuple(prompt_ids), 200, SamplingParams(temperature=0.0), ignore_eos=True
    )
    seq = make_sequence(request, tokenizer)
    engine.admit(seq)
    while engine.active is not None:
        engine.step()
    reference_model = load(str(STORIES))[0]
    expected = [t for t, _ in generate_step(mx.array(prompt_ids), reference_model, max_tokens=200)]
    assert seq.generated == expected
    assert seq.spec.accepted_tokens > 0
    assert seq.spec.accepted_tokens <= seq.spec.draft_tokens
