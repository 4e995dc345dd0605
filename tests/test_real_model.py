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
