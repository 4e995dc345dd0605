"""Prefix reuse: a repeated system prompt or a multi-turn chat skips the prefill of
what an earlier request already computed, in both engines, with unchanged output."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from mlx_lm import generate

from engines.request import GenerationRequest, SamplingParams
from scheduler.prefix_cache import PrefixCache
from tests.conftest import make_client, start_scheduler

SYSTEM = "You are a careful assistant. Answer briefly and never repeat yourself. " * 3


@pytest.fixture
def fresh_scheduler(tiny_model_dir):
    scheduler = start_scheduler(tiny_model_dir)
    yield scheduler
    scheduler.stop()


def chat(user: str, *history: dict) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": user}]


async def test_repeated_system_prompt_is_served_from_cache(fresh_scheduler, reference):
    registry = fresh_scheduler.registry
    async with make_client(fresh_scheduler) as client:
        first = await client.post(
            "/v1/chat/completions",
            json={"messages": chat("Say hi."), "max_tokens": 8, "temperature": 0},
        )
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        before = registry.tokens_processed
        messages = chat("Say bye.")
        second = await client.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 8, "temperature": 0},
        )
    usage = second.json()["usage"]
    system_tokens = len(reference.tokenizer.encode(SYSTEM))
    assert usage["prompt_tokens_details"]["cached_tokens"] >= system_tokens
    fed = registry.tokens_processed - before
    drafted = second.json()["speculation"]["draft_tokens"]
    uncached = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    assert fed <= uncached + usage["completion_tokens"] + drafted + 1
    prompt = reference.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    expected = generate(reference.model, reference.tokenizer, prompt, max_tokens=8)
    assert second.json()["choices"][0]["message"]["content"] == expected


async def test_multi_turn_chat_reuses_the_previous_turn(fresh_scheduler, reference):
    async with make_client(fresh_scheduler) as client:
        turn1 = chat("Tell me a story.")
        r1 = await client.post(
            "/v1/chat/completions",
            json={"messages": turn1, "max_tokens": 12, "temperature": 0},
        )
        reply = r1.json()["choices"][0]["message"]["content"]
        turn2 = chat(
            "Another one.",
            {"role": "user", "content": "Tell me a story."},
            {"role": "assistant", "content": reply},
        )
        turn2 = [turn2[0], *turn2[1:]]
        r2 = await client.post(
            "/v1/chat/completions",
            json={"messages": turn2, "max_tokens": 12, "temperature": 0},
        )
    cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= r1.json()["usage"]["prompt_tokens"] - 1


def after_system(reference, max_tokens: int):
    """A maker of greedy requests whose prompt is SYSTEM followed by a suffix."""
    system_ids = reference.tokenizer.encode(SYSTEM)

    def request(rid: str, suffix: str) -> GenerationRequest:
        ids = system_ids + reference.tokenizer.encode(suffix, add_special_tokens=False)
        greedy = SamplingParams(temperature=0.0)
        return GenerationRequest(rid, tuple(ids), max_tokens, greedy, ignore_eos=True)

    return system_ids, request


async def test_batched_requests_hit_the_cache_too(fresh_scheduler, reference):
    system_ids, request = after_system(reference, 20)

    await fresh_scheduler.submit(request("warm", " first")).collect()
    streams = [fresh_scheduler.submit(request(f"b{i}", f" question {i}")) for i in range(3)]
    results = await asyncio.gather(*(s.collect() for s in streams))
    assert fresh_scheduler.batched_engine is not None
    for i, events in enumerate(results):
        assert events[-1].cached_tokens >= len(system_ids) - 1
        tokens = [t for e in events for t in e.token_ids]
        prompt = list(request("x", f" question {i}").prompt_tokens)
        assert tokens == reference.greedy_tokens(prompt, 20)


def test_lookup_always_leaves_one_token_to_feed(tiny_model_dir, reference):
    from mlx_lm.models.cache import make_prompt_cache

    cache = PrefixCache(max_entries=2)
    kv = make_prompt_cache(reference.model)
    tokens = reference.tokenizer.encode("Once upon a time")
    import mlx.core as mx

    reference.model(mx.array(tokens)[None], cache=kv)
    cache.store(tokens, kv)
    hit = cache.lookup(tokens)
    assert hit.cached == len(tokens) - 1 and hit.cache[0].offset == len(tokens) - 1
    assert hit.draft is None
    other = reference.tokenizer.encode("Completely different")
    common = next(i for i, (a, b) in enumerate(zip(tokens, other, strict=False)) if a != b)
    assert common == 1, "only BOS is shared"
    partial = cache.lookup(other)
    assert partial.cached == common and partial.cache[0].offset == common
    assert cache.lookup([9999, 1, 2]) is None


async def test_a_plain_turn_ending_in_eos_is_stored_for_the_next_turn(tiny_model_dir, reference):
    """Without drafting, plain steps are pipelined: the request ends (EOS at token 5)
    with one more token already in flight. Its cache still holds exactly the committed
    tokens and must be kept, so the next turn is served from it."""
    eos = min(reference.tokenizer.eos_token_ids)

    def eos_at_five(request: GenerationRequest) -> list:
        prompt_length = len(request.prompt_tokens)

        def force(tokens, logits):
            if len(tokens) - prompt_length == 5:
                keep = mx.arange(logits.shape[-1]) == eos
                return mx.where(keep, logits, -1e9)
            return logits

        return [force] if request.request_id.startswith("turn1") else []

    scheduler = start_scheduler(
        tiny_model_dir, enable_pld=False, logits_processor_factory=eos_at_five
    )
    try:
        prompt = reference.tokenizer.encode(SYSTEM)
        greedy = SamplingParams(temperature=0.0)
        events = await scheduler.submit(
            GenerationRequest("turn1", tuple(prompt), 50, greedy)
        ).collect()
        generated = [t for e in events for t in e.token_ids]
        assert events[-1].finish_reason.value == "stop" and generated[-1] == eos
        assert len(generated) == 6
        follow_up = [*prompt, *generated, *reference.tokenizer.encode(" And then?")]
        events = await scheduler.submit(
            GenerationRequest("turn2", tuple(follow_up), 4, greedy)
        ).collect()
        assert events[-1].cached_tokens >= len(prompt) + len(generated)
    finally:
        scheduler.stop()


async def test_failed_batched_request_leaves_no_cache_longer_than_its_key(
    tiny_model_dir, reference
):
    """A commit that raises in the batched engine has already fed its token to the KV
    cache; what the failed request leaves for reuse must hold only committed tokens."""
    from engines.errors import RequestFailed

    scheduler = start_scheduler(tiny_model_dir, fault_marker="FAULT")
    try:
        greedy = SamplingParams(temperature=0.0)
        bad_prompt = reference.tokenizer.encode("FAULT: once upon a time there was")
        other_prompt = reference.tokenizer.encode("Completely different words here")
        bad = scheduler.submit(GenerationRequest("bad", tuple(bad_prompt), 20, greedy))
        other = scheduler.submit(
            GenerationRequest("other", tuple(other_prompt), 30, greedy, ignore_eos=True)
        )
        with pytest.raises(RequestFailed):
            await bad.collect()
        await other.collect()
        assert scheduler.batched_engine is not None, "the fault must hit the batched engine"
        # A prompt that extends the failed one (it carries the marker too, so it asks for
        # fewer tokens than the fault needs).
        committed = reference.greedy_tokens(bad_prompt, 3)
        more = reference.tokenizer.encode(" and then", add_special_tokens=False)
        extended = [*bad_prompt, *committed, *more]
        events = await scheduler.submit(
            GenerationRequest("ext", tuple(extended), 3, greedy, ignore_eos=True)
        ).collect()
    finally:
        scheduler.stop()
    assert events[-1].cached_tokens >= len(bad_prompt)
    assert [t for e in events for t in e.token_ids] == reference.greedy_tokens(extended, 3)


async def test_prefix_cache_is_partitioned_by_api_key(fresh_scheduler):
    """One key cannot learn from `cached_tokens` what another key's prompts were."""
    messages = chat("What is my secret plan?")
    async with make_client(fresh_scheduler, api_keys=("key-a", "key-b")) as client:

        async def openai_chat(key: str) -> int:
            response = await client.post(
                "/v1/chat/completions",
                json={"messages": messages, "max_tokens": 4, "temperature": 0},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert response.status_code == 200, response.text
            return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        async def anthropic_messages(key: str) -> int:
            response = await client.post(
                "/v1/messages",
                json={"system": SYSTEM, "messages": messages[1:], "max_tokens": 4},
                headers={"x-api-key": key},
            )
            assert response.status_code == 200, response.text
            return response.json()["usage"]["cache_read_input_tokens"]

        assert await openai_chat("key-a") == 0
        assert await openai_chat("key-b") == 0, "key B saw key A's prompt in the cache"
        assert await anthropic_messages("key-b") > 0, "B's own entry is B's to reuse"
        assert await openai_chat("key-a") > 0


async def test_a_busy_key_evicts_its_own_entries_not_another_keys(tiny_model_dir):
    """A 4-entry cache on a shared box: key A holds a conversation; key B then sends
    more requests than the cache holds. B's flood evicts B's older entries, and A's
    next turn is still served from A's entry (a shared LRU would have dropped it)."""
    scheduler = start_scheduler(tiny_model_dir, prefix_cache_entries=4)
    try:
        async with make_client(scheduler, api_keys=("key-a", "key-b")) as client:

            async def ask(key: str, question: str) -> int:
                response = await client.post(
                    "/v1/chat/completions",
                    json={"messages": chat(question), "max_tokens": 4, "temperature": 0},
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert response.status_code == 200, response.text
                return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

            assert await ask("key-a", "What is my secret plan?") == 0
            flood = [await ask("key-b", f"Question number {i} from B?") for i in range(8)]
            assert flood[0] == 0 and all(cached > 0 for cached in flood[1:])
            assert await ask("key-a", "What is my secret plan again?") > 0
        assert len(scheduler._prefix) <= 4
    finally:
        scheduler.stop()


def _filled(model, tokens: list[int]) -> list:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache))
    return cache


@pytest.mark.parametrize("lag", [0, 3, 40])
def test_an_entry_keeps_the_draft_cache_cut_to_the_tokens_both_hold(
    reference, perturbed_draft_dir, lag
):
    """A hit hands back the draft model's cache of exactly the tokens it claims, so a
    hit drafts at once; a draft cache far behind the target's is not kept (the
    target's entry then keeps all its tokens)."""
    from mlx_lm import load

    from engines.drafting.draft_model import DraftState

    draft_model, _ = load(str(perturbed_draft_dir))
    tokens = reference.tokenizer.encode("Once upon a time there was a little robot " * 6)
    assert len(tokens) > 50
    target = _filled(reference.model, tokens)
    fed = tokens[: len(tokens) - lag] + [7, 7]  # two rejected drafts after the shared part
    cache = PrefixCache(max_entries=4)
    cache.store(tokens, target, draft=DraftState(_filled(draft_model, fed), fed))
    query = tokens + reference.tokenizer.encode(" and then", add_special_tokens=False)
    hit = cache.lookup(query)
    kept = len(tokens) if lag > 16 else len(tokens) - lag
    assert hit.cached == kept and all(layer.offset == kept for layer in hit.cache)
    if lag > 16:
        assert hit.draft is None
        return
    assert hit.draft.fed == query[:kept]
    assert all(layer.offset == kept for layer in hit.draft.cache)
    # The kept draft cache is the draft model's cache of those tokens: its next logits
    # equal a fresh prefill's.
    following = mx.array(query[kept : kept + 2])[None]
    fresh = _filled(draft_model, query[:kept])
    expected = draft_model(following, cache=fresh)
    assert mx.allclose(draft_model(following, cache=hit.draft.cache), expected, atol=1e-4)


async def test_prefix_hits_with_draft_caches_stay_exact_in_both_engines(
    tiny_model_dir, perturbed_draft_dir, reference
):
    """Requests that start from a stored target and draft cache -- alone (speculative
    engine) and three at once (batched speculation) -- decode exactly as plain
    decoding does, and report the hit."""
    scheduler = start_scheduler(tiny_model_dir, draft_model=str(perturbed_draft_dir))
    try:
        system_ids, request = after_system(reference, 24)
        await scheduler.submit(request("warm", " first")).collect()
        alone = await scheduler.submit(request("alone", " first")).collect()
        assert alone[-1].cached_tokens >= len(system_ids)
        streams = [scheduler.submit(request(f"b{i}", " first")) for i in range(3)]
        results = [alone, *await asyncio.gather(*(s.collect() for s in streams))]
        assert scheduler.batched_engine is not None
        expected = reference.greedy_tokens(list(request("x", " first").prompt_tokens), 24)
        for events in results:
            assert events[-1].cached_tokens >= len(system_ids)
            assert [t for e in events for t in e.token_ids] == expected
    finally:
        scheduler.stop()


def test_the_byte_bound_evicts_from_the_scope_holding_the_most_bytes(reference):
    """Over the byte bound, the scope holding the most bytes gives up its oldest entry;
    the other scope's entry stays."""
    tokenizer, model = reference.tokenizer, reference.model
    texts = ["Once upon a time there was", "The dog ran to the park and", "A bird sang"]
    entry = _filled(model, tokenizer.encode(texts[0]))
    cache = PrefixCache(max_entries=10, max_bytes=int(2.5 * sum(c.nbytes for c in entry)))
    cache.store(tokenizer.encode(texts[0]), entry, scope="a")
    for text in texts[1:]:
        cache.store(tokenizer.encode(text), _filled(model, tokenizer.encode(text)), scope="b")
    assert len(cache) == 2 and cache.nbytes <= cache.max_bytes
    assert cache.lookup(tokenizer.encode(texts[0]), scope="a") is not None
    evicted = cache.lookup(tokenizer.encode(texts[1]), scope="b")
    assert evicted is None or evicted.cached <= 1  # a shared BOS at most
    assert cache.lookup(tokenizer.encode(texts[2]), scope="b").cached > 1


def test_an_entry_over_the_byte_bound_leaves_nothing_behind(reference):
    """An entry larger than the whole byte bound is not kept, and its key keeps no
    empty partition (a key per client must not grow the cache's bookkeeping)."""
    tokens = reference.tokenizer.encode("Once upon a time there was")
    entry = _filled(reference.model, tokens)
    cache = PrefixCache(max_entries=4, max_bytes=sum(c.nbytes for c in entry) // 2)
    cache.store(tokens, entry, scope="a")
    assert len(cache) == 0 and cache.nbytes == 0
    assert cache.lookup(tokens, scope="a") is None
    assert not cache._scopes
