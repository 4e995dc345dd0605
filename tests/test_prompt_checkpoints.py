"""Prompt checkpoints: a prompt prefilled into caches that cannot be cut back later
(recurrent state) is kept in the prefix cache as it stands before its newest token,
so the same prompt again -- a retry, another choice, the same document asked again --
feeds one token instead of the whole prompt, as mlx_lm.server does for such models.
A finished request's cache alone cannot serve that repeat: it holds the generated
tokens too, and recurrent state cannot be trimmed back to the prompt.

Tiny Qwen3-Next and LFM2 hybrids through the real scheduler, alone (single-stream
engine) and concurrent (batched engine): the repeat hits, its output equals mlx-lm's
token for token, and another API key's identical prompt does not hit. Chats keep a checkpoint
where their system prompt ends, so another conversation with it starts there."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from mlx_lm import load

from engines.request import GenerationRequest, SamplingParams
from tests.conftest import Reference, make_client, start_scheduler
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


# ---- chats sharing a system prompt ------------------------------------------------

SYSTEM = "You are a careful assistant who answers in short sentences. " * 6


async def chat(client, question: str, system: str = SYSTEM) -> tuple[str, int]:
    response = await client.post(
        "/v1/chat/completions",
        json={
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]


async def test_conversations_sharing_a_system_prompt_start_after_it(hybrid, tmp_path):
    """Different users' first turns with one system prompt: the second starts from the
    checkpoint the first kept where the system prompt ends (recurrent state cannot be
    cut back from the first's longer cache), and answers as a server without any
    prefix cache does."""
    scheduler, reference = hybrid
    questions = ["Tell me about robots.", "What is the weather like in the hills?"]
    shared = shared_system_tokens(reference.tokenizer, questions)
    async with make_client(scheduler) as client:
        answers = [await chat(client, q) for q in questions]
    assert answers[0][1] == 0
    assert answers[1][1] == shared > len(reference.tokenizer.encode(SYSTEM)) // 2
    uncached = start_scheduler(scheduler.config.model, prefix_cache_entries=0)
    try:
        async with make_client(uncached) as client:
            plain = [await chat(client, q) for q in questions]
    finally:
        uncached.stop()
    assert [text for text, _ in answers] == [text for text, _ in plain]
    assert all(cached == 0 for _, cached in plain)


async def test_a_system_checkpoint_outlives_busier_entries(hybrid):
    """A small prefix cache filled by other requests after a conversation (each leaves a
    prompt checkpoint and a finished cache): the system prompt's checkpoint is evicted
    last, so the next conversation with that system prompt still starts after it."""
    scheduler, reference = hybrid
    small = start_scheduler(scheduler.config.model, prefix_cache_entries=4)
    questions = ["Tell me about robots.", "What is the weather like in the hills?"]
    try:
        async with make_client(small) as client:
            assert (await chat(client, questions[0]))[1] == 0
            for i, text in enumerate(PROMPTS * 3):
                prompt = reference.tokenizer.encode(f"{i} {text}")
                _, cached = await run(small, greedy(f"other-{i}", prompt, 4, "key-a"))
                assert cached == 0
            answer, cached = await chat(client, questions[1])
    finally:
        small.stop()
    assert cached == shared_system_tokens(reference.tokenizer, questions)


def shared_system_tokens(tokenizer, questions: list[str], system: str = SYSTEM) -> int:
    """The tokens the two rendered conversations share (the system prompt and the
    user turn's opening), rendered as the server renders them."""
    from server.prompts import render_chat

    ids = [
        render_chat(
            tokenizer,
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            checkpoint_system=True,
        )
        for q in questions
    ]
    assert ids[0].checkpoints == ids[1].checkpoints
    return ids[0].checkpoints[0]


async def test_concurrent_conversations_share_the_system_checkpoint(hybrid):
    """Conversations arriving together with one system prompt: at most the first
    prefills it (the others may start from its checkpoint already); the next ones all
    start after it, and answer as a server without any prefix cache does."""
    scheduler, reference = hybrid
    system = "Answer like a ship's captain, briefly and kindly. " * 6
    questions = ["Where are we going?", "Is a storm coming?", "Who cooks?", "Any fish?"]
    async with make_client(scheduler) as client:
        first = await asyncio.gather(*(chat(client, q, system) for q in questions[:2]))
        second = await asyncio.gather(*(chat(client, q, system) for q in questions[2:]))
    shared = shared_system_tokens(reference.tokenizer, questions[2:], system)
    assert sorted(cached for _, cached in first) in ([0, 0], [0, shared])
    assert [cached for _, cached in second] == [shared, shared]
    uncached = start_scheduler(scheduler.config.model, prefix_cache_entries=0)
    try:
        async with make_client(uncached) as client:
            plain = await asyncio.gather(*(chat(client, q, system) for q in questions[2:]))
    finally:
        uncached.stop()
    assert [text for text, _ in second] == [text for text, _ in plain]


def test_a_batched_prefill_keeps_checkpoints_that_continue_exactly(tmp_path, tiny_model_dir):
    """The batched engine prefilling two prompts stops each at its checkpoint and at
    its end and keeps both caches; a request started from a checkpoint (another
    question after the shared part) decodes what mlx-lm decodes from scratch."""
    from engines.sequence import make_sequence
    from engines.state import SequenceState
    from tests.test_batched_speculation import make_engines, run_batch

    path = build_tiny_arch("qwen3_next", tmp_path / "qwen3_next", tiny_model_dir)
    reference = Reference(*load(str(path)))
    _, engine = make_engines(path)
    engine.checkpoint_prompts = True
    shared = reference.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[1])
    prompts = [shared + reference.tokenizer.encode(q) for q in (" Why?", " And then what?")]
    point = len(shared)
    requests = [
        dataclasses.replace(greedy(f"c{i}", p, 20), checkpoints=(point,))
        for i, p in enumerate(prompts)
    ]
    results = []
    seqs, _, _ = run_batch(engine, requests, results=results)
    for i, prompt in enumerate(prompts):
        assert seqs[f"c{i}"].generated == reference.greedy_tokens(prompt, 20)
    checkpoints = [state for r in results for state in r.checkpoints]
    kept = sorted(state.cached for state in checkpoints)
    assert kept == sorted([point, point, len(prompts[0]) - 1, len(prompts[1]) - 1])
    checkpoint = next(state for state in checkpoints if state.cached == point)
    follow_up = shared + reference.tokenizer.encode(" What is the moral of it?")
    seq = make_sequence(greedy("follow", follow_up, 20), engine.registry.tokenizer)
    engine.admit(SequenceState(seq, checkpoint.cache, point))
    while engine.batch_size:
        engine.step()
    assert seq.generated == reference.greedy_tokens(follow_up, 20)
