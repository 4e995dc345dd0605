"""Prompt checkpoints: a prompt prefilled into caches that cannot be cut back later
(recurrent state) is kept in the prefix cache as it stands before its newest token,
so the same prompt again -- a retry, another choice, the same document asked again --
feeds one token instead of the whole prompt, as mlx_lm.server does for such models.
A finished request's cache alone cannot serve that repeat: it holds the generated
tokens too, and recurrent state cannot be trimmed back to the prompt.

Tiny Qwen3-Next and LFM2 hybrids through the real scheduler, alone (single-stream
engine) and concurrent (batched engine): the repeat hits, its output equals mlx-lm's
token for token, and another API key's identical prompt does not hit."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from mlx_lm import load

from engines.request import GenerationRequest, SamplingParams
from tests.conftest import Reference, start_scheduler
from tests.tiny_archs import build_tiny_arch

PROMPTS = [
    "Once upon a time there was a robot who liked to read long books about the sea",
    "The weather in the mountains changes quickly, so pack a coat and a map",
]


@pytest.fixture(scope="module", params=["qwen3_next", "lfm2"])
def hybrid(request, tmp_path_factory, tiny_model_dir):
    kind = request.param
    path = build_tiny_arch(kind, tmp_path_factory.mktemp("checkpoints") / kind, tiny_model_dir)
    scheduler = start_scheduler(path)
    yield scheduler, Reference(*load(str(path)))
    scheduler.stop()


def greedy(rid: str, prompt: list[int], max_tokens: int = 30, scope: str = "key-a"):
    return GenerationRequest(
        rid,
        tuple(prompt),
        max_tokens,
        SamplingParams(temperature=0.0),
        ignore_eos=True,
        cache_scope=scope,
    )


async def run(scheduler, request) -> tuple[list[int], int]:
    events = await scheduler.submit(request).collect()
    return [t for e in events for t in e.token_ids], events[-1].cached_tokens


async def test_a_repeated_prompt_starts_from_its_checkpoint_alone(hybrid):
    scheduler, reference = hybrid
    prompt = reference.tokenizer.encode(PROMPTS[0])
    expected = reference.greedy_tokens(prompt, 30)
    first, cached_first = await run(scheduler, greedy("alone-1", prompt))
    again, cached_again = await run(scheduler, greedy("alone-2", prompt))
    assert first == expected and again == expected
    assert cached_first == 0
    assert cached_again == len(prompt) - 1, "only the newest prompt token was fed"
    other, cached_other = await run(scheduler, greedy("other-key", prompt, scope="key-b"))
    assert other == expected and cached_other == 0, "another key's checkpoint is invisible"


async def test_repeated_prompts_in_a_batch_start_from_their_checkpoints(hybrid):
    scheduler, reference = hybrid
    prompts = [reference.tokenizer.encode(p + " again") for p in PROMPTS]
    expected = [reference.greedy_tokens(p, 24) for p in prompts]

    async def together(tag: str):
        requests = [greedy(f"{tag}-{i}", p, 24) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(run(scheduler, r) for r in requests))

    first = await together("batch-1")
    again = await together("batch-2")
    assert [tokens for tokens, _ in first] == expected
    assert [tokens for tokens, _ in again] == expected
    assert all(cached == len(p) - 1 for (_, cached), p in zip(again, prompts, strict=True))


async def test_a_longer_prompt_starts_from_a_checkpoint_of_its_prefix(hybrid):
    """The checkpoint is a shorter prefix of a follow-up that extends the prompt."""
    scheduler, reference = hybrid
    prompt = reference.tokenizer.encode(PROMPTS[1] + " today")
    await run(scheduler, greedy("prefix-1", prompt, 8))
    longer = prompt + reference.tokenizer.encode(" and tomorrow too")
    request = dataclasses.replace(greedy("prefix-2", longer, 20))
    tokens, cached = await run(scheduler, request)
    assert tokens == reference.greedy_tokens(longer, 20)
    assert cached >= len(prompt) - 1
