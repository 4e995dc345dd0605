"""Prefill followers: a request whose prompt shares a long prefix with a prompt of its
API key still being prefilled waits for that prefill and starts from it, instead of
prefilling the same tokens a second time (agents of one team starting together).

The engines stop a prefill chunk at a position asked for (`Sequence.keep_at`) and copy
the cache out there; the scheduler keeps the newcomer waiting until then, and not
across keys. Outputs stay exactly mlx-lm's."""

from __future__ import annotations

import asyncio

import openai
import pytest
from mlx_lm import load

from engines.errors import RequestFailed
from engines.request import GenerationRequest, common_prefix
from engines.sequence import Sequence, make_sequence
from scheduler.counters import SchedulerCounters
from scheduler.prefill_followers import PrefillFollowers
from scheduler.prefix_cache import PrefixCache
from scheduler.prefix_reuse import PrefixReuse
from scheduler.requests import RequestTable
from scheduler.stream import RequestStream
from scheduler.tracking import TrackedRequest
from tests.conftest import MODEL_NAME, Reference, make_client, start_scheduler
from tests.test_batched_speculation import CODE_PROMPT, greedy_request, make_engines
from tests.tiny_archs import build_tiny_arch

CHUNK = 64
K1, K2 = "key-one-" + "1" * 24, "key-two-" + "2" * 24
MAX_TOKENS = 8


def prompt_of(reference, length: int, text: str = CODE_PROMPT) -> list[int]:
    prompt = reference.tokenizer.encode(text * 40)[:length]
    assert len(prompt) == length
    return prompt


def keyed(rid: str, prompt: list[int], scope: str = "key-a", **kw) -> GenerationRequest:
    return greedy_request(rid, prompt, MAX_TOKENS, cache_scope=scope, **kw)


def tokens_of(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


# ---- the engines keep a copy where asked -----------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return make_engines(tiny_model_dir, prefill_step_size=CHUNK)


@pytest.fixture(scope="module")
def drafting(tiny_model_dir, perturbed_draft_dir):
    return make_engines(tiny_model_dir, perturbed_draft_dir, prefill_step_size=CHUNK)


@pytest.mark.parametrize(
    ("which", "pair"), [("single", "engines"), ("batched", "engines"), ("batched", "drafting")]
)
def test_an_engine_copies_the_cache_out_at_a_kept_position(request, reference, which, pair):
    """The prefill chunk stops at the kept position (not a chunk boundary), the copy
    there serves another request exactly, and the leader's own tokens do not change.
    With a draft model, the batched engine (which feeds it the prompt beside the target)
    copies the draft's cache too, so the follower neither waits for the draft to be fed
    the shared prompt before its first token nor before its first draft."""
    spec, batched = request.getfixturevalue(pair)
    engine = spec if which == "single" else batched
    engine.registry.transfer(engine.name)
    prompt, kept_at = prompt_of(reference, 300), 150
    seq = make_sequence(greedy_request("leader", prompt, MAX_TOKENS), reference.tokenizer)
    seq.keep_at.add(kept_at)
    engine.admit(seq)
    copies, tokens = [], []
    while engine.active_ids:
        result = engine.step()
        copies += result.checkpoints
        tokens += [t for o in result.outputs for t in o.token_ids]
    assert tokens == reference.greedy_tokens(prompt, MAX_TOKENS)
    assert [c.cached for c in copies] == [kept_at]
    assert seq.prefilled == len(prompt) - 1
    if pair == "drafting":
        fed = copies[0].drafting.draft.fed  # fed in chunks of its own: the store cuts it back
        assert kept_at <= len(fed) and fed == prompt[: len(fed)]

    reuse = PrefixReuse(PrefixCache())
    reuse.keep([], copies)
    other = prompt[:kept_at] + prompt_of(reference, 41, "x = [i * i for i in range(9)]\n")[1:]
    follower = make_sequence(greedy_request("follower", other, MAX_TOKENS), reference.tokenizer)
    start = reuse.start(follower, engine.registry.target.model)
    assert start.cached == kept_at
    if pair == "drafting":
        assert start.drafting.draft.fed == other[:kept_at]
    engine.admit(start)
    tokens = []
    while engine.active_ids:
        tokens += [t for o in engine.step().outputs for t in o.token_ids]
    assert tokens == reference.greedy_tokens(other, MAX_TOKENS)


# ---- through the scheduler -----------------------------------------------------------


@pytest.fixture
def scheduler(follow_scheduler):
    return follow_scheduler


async def test_the_same_prompt_sent_twice_at_once_is_prefilled_once(scheduler, reference):
    prompt = prompt_of(reference, 300)
    first = scheduler.submit(keyed("first", prompt))
    second = scheduler.submit(keyed("second", prompt))
    a, b = await asyncio.gather(first.collect(), second.collect())
    expected = reference.greedy_tokens(prompt, MAX_TOKENS)
    assert tokens_of(a) == expected and tokens_of(b) == expected
    assert a[-1].cached_tokens == 0
    assert b[-1].cached_tokens == len(prompt) - 1  # only the newest token fed
    assert scheduler.counters.prefill_follows == {"served": 1}


async def test_a_shared_prefix_serves_a_prompt_that_goes_on_differently(scheduler, reference):
    """Two prompts share 200 tokens and then differ: the newcomer starts at exactly the
    200 they share (the leader's copy there, or one further along cut back to it)."""
    shared = prompt_of(reference, 200)
    one = shared + prompt_of(reference, 61, "print('one')\n")[1:]  # without BOS
    two = shared + prompt_of(reference, 71, "while True:\n    pass\n")[1:]
    assert common_prefix(one, two) == 200
    first = scheduler.submit(keyed("one", one))
    second = scheduler.submit(keyed("two", two))
    a, b = await asyncio.gather(first.collect(), second.collect())
    assert tokens_of(a) == reference.greedy_tokens(one, MAX_TOKENS)
    assert tokens_of(b) == reference.greedy_tokens(two, MAX_TOKENS)
    assert b[-1].cached_tokens == 200
    assert scheduler.counters.prefill_follows == {"served": 1}


async def test_another_keys_prompt_never_waits_for_it_nor_starts_from_it(scheduler, reference):
    """The same prompt under another key, while key-a's twin prefills: it is prefilled
    on its own (no faster, nothing of key-a's reported), and key-a's twin still waits."""
    prompt = prompt_of(reference, 300)
    streams = [
        scheduler.submit(keyed("a-1", prompt, "key-a")),
        scheduler.submit(keyed("b-1", prompt, "key-b")),
        scheduler.submit(keyed("a-2", prompt, "key-a")),
    ]
    a1, b1, a2 = await asyncio.gather(*(s.collect() for s in streams))
    expected = reference.greedy_tokens(prompt, MAX_TOKENS)
    assert tokens_of(a1) == tokens_of(b1) == tokens_of(a2) == expected
    assert b1[-1].cached_tokens == 0
    assert a2[-1].cached_tokens == len(prompt) - 1
    assert scheduler.counters.prefill_follows == {"served": 1}


async def test_a_cancelled_leader_leaves_its_prefill_to_the_follower(tiny_model_dir, reference):
    """The leader's client goes away mid-prefill: the follower stops waiting at once
    and starts from what the leader had prefilled (kept for the key), exactly."""
    scheduler = start_scheduler(tiny_model_dir, prefill_step_size=16, prefill_follow_min_tokens=100)
    try:
        prompt = prompt_of(reference, 600)
        leader = scheduler.submit(keyed("leader", prompt))
        follower = scheduler.submit(keyed("follower", prompt))
        engine = scheduler.speculative_engine
        for _ in range(5000):
            active = engine.active
            if active is not None and 64 <= active.cached < len(prompt) - 1:
                break
            await asyncio.sleep(0.001)
        else:
            raise AssertionError("never saw the leader part-prefilled")
        leader.cancel()
        events = await asyncio.wait_for(follower.collect(), 60)
        assert tokens_of(events) == reference.greedy_tokens(prompt, MAX_TOKENS)
        assert events[-1].cached_tokens >= 64
        assert scheduler.counters.prefill_follows == {"left": 1}
    finally:
        scheduler.stop()


async def test_a_leader_that_fails_in_prefill_leaves_the_follower_to_prefill_alone(
    tiny_model_dir, reference
):
    """The leader's prefill chunk fails (an injected fault, in the batched engine that
    another key's request started): only the leader fails; its follower stops waiting
    and prefills the shared part itself, and every other answer is exact."""
    scheduler = start_scheduler(
        tiny_model_dir, prefill_step_size=CHUNK, prefill_follow_min_tokens=100, fault_marker="FAULT"
    )
    try:
        shared, tokenizer = prompt_of(reference, 300), reference.tokenizer
        failing = shared + tokenizer.encode(" FAULT@prefill")[1:]
        other = prompt_of(reference, 120, "Once upon a time there was a robot. ")
        streams = [
            scheduler.submit(keyed("other", other, "key-b")),
            scheduler.submit(keyed("leader", failing)),
            scheduler.submit(keyed("follower", shared)),
        ]
        collected = asyncio.gather(*(s.collect() for s in streams), return_exceptions=True)
        done = await asyncio.wait_for(collected, 60)
        by_id = dict(zip(("other", "leader", "follower"), done, strict=True))
        assert isinstance(by_id["leader"], RequestFailed), by_id["leader"]
        assert "injected fault at prefill" in str(by_id["leader"])
        assert tokens_of(by_id["other"]) == reference.greedy_tokens(other, MAX_TOKENS)
        assert tokens_of(by_id["follower"]) == reference.greedy_tokens(shared, MAX_TOKENS)
        assert by_id["follower"][-1].cached_tokens == 0
        assert scheduler.counters.prefill_follows == {"left": 1}
    finally:
        scheduler.stop()


@pytest.mark.parametrize("kind", ["qwen3_next", "lfm2"])
async def test_a_cache_that_cannot_be_cut_back_is_copied_at_exactly_the_shared_part(
    kind, tmp_path, tiny_model_dir
):
    """Recurrent layers (tiny Qwen3-Next and LFM2 hybrids): a copy further along could
    not serve the follower, so the leader's prefill stops at the shared position and is
    copied there; the follower starts at exactly that position, both answers mlx-lm's."""
    path = build_tiny_arch(kind, tmp_path / kind, tiny_model_dir)
    reference = Reference(*load(str(path)))
    scheduler = start_scheduler(path, prefill_step_size=16, prefill_follow_min_tokens=16)
    try:
        encode = reference.tokenizer.encode
        shared = encode("Once upon a time there was a robot who liked to read long books " * 3)
        one = shared + encode(" about the sea")[1:]
        two = shared + encode(" and then it went to sleep under a tree")[1:]
        assert common_prefix(one, two) == len(shared) >= 32
        first = scheduler.submit(keyed("one", one))
        second = scheduler.submit(keyed("two", two))
        a, b = await asyncio.gather(first.collect(), second.collect())
        assert tokens_of(a) == reference.greedy_tokens(one, MAX_TOKENS)
        assert tokens_of(b) == reference.greedy_tokens(two, MAX_TOKENS)
        assert b[-1].cached_tokens == len(shared)
        assert scheduler.counters.prefill_follows == {"served": 1}
    finally:
        scheduler.stop()


async def test_followers_can_be_turned_off(tiny_model_dir, reference):
    scheduler = start_scheduler(
        tiny_model_dir, prefill_step_size=CHUNK, prefill_follow_min_tokens=0
    )
    try:
        prompt = prompt_of(reference, 300)
        first = scheduler.submit(keyed("first", prompt))
        second = scheduler.submit(keyed("second", prompt))
        a, b = await asyncio.gather(first.collect(), second.collect())
        assert tokens_of(a) == tokens_of(b) == reference.greedy_tokens(prompt, MAX_TOKENS)
        assert scheduler.counters.prefill_follows == {}
    finally:
        scheduler.stop()


async def test_agents_starting_together_through_the_openai_sdk(tiny_model_dir, reference):
    """Three agents send the same long system prompt at once, two with one API key and
    one with another: the key's second starts from the first's prefill, the other key's
    prefills its own, and /metrics and /v1/stats count the one wait. The prefill runs in
    2-token chunks in either engine, so it is still running when the key's second request
    has passed the HTTP stack (requests rendered at once reach the engine up to ~0.25 s
    apart on a busy box, where the tiny model prefills 425 tokens in one 30 ms chunk)."""
    scheduler = start_scheduler(
        tiny_model_dir,
        prefill_step_size=2,
        batch_prefill_step_size=2,
        prefill_follow_min_tokens=100,
    )
    try:
        system = reference.tokenizer.decode(prompt_of(reference, 400)[1:])
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "go"}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        async with make_client(scheduler, api_keys=(K1, K2)) as http:
            replies = await asyncio.gather(
                *(sdk(http, key).chat.completions.create(**body) for key in (K1, K2, K1))
            )
            metrics = (await http.get("/metrics", headers={"Authorization": f"Bearer {K1}"})).text
            stats = (await http.get("/v1/stats", headers={"Authorization": f"Bearer {K1}"})).json()
        cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
        prompt_tokens = replies[0].usage.prompt_tokens
        assert prompt_tokens > 300
        # whichever of K1's two the server took first leads; K2's is prefilled on its own
        assert sorted([cached[0], cached[2]]) == [0, prompt_tokens - 1] and cached[1] == 0
        assert len({r.choices[0].message.content for r in replies}) == 1
        assert (
            f'tandem_prefill_follows_total{{model_name="{MODEL_NAME}",outcome="served"}} 1.0'
            in metrics
        )
        assert stats["prefill_follows"] == {"served": 1}
    finally:
        scheduler.stop()


def sdk(http, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://tandem.test/v1", api_key=key, http_client=http, max_retries=0
    )


# ---- who waits for whom, and for how long (real requests, no model) -----------------


class Queue:
    """A request table with requests in it, and the followers' rules over it."""

    def __init__(self, stall_seconds: float = 60.0, cuts_back: bool = True) -> None:
        self.table = RequestTable()
        self.counters = SchedulerCounters()
        self.followers = PrefillFollowers(PrefixCache(), self.counters, 100, stall_seconds)
        self.followers.cuts_back = cuts_back
        self.clock = 1000.0

    def add(self, rid: str, prompt: list[int], scope: str = "key-a", **kw) -> TrackedRequest:
        request = keyed(rid, prompt, scope, **kw)
        tracked = TrackedRequest(
            request, RequestStream(rid, lambda _: None), None, arrived=self.clock
        )
        self.clock += 1
        self.table.waiting.append(tracked)
        return tracked

    def start(self, tracked: TrackedRequest, prefilled: int = 0) -> None:
        """Running, with `prefilled` prompt tokens in its cache (as `_start` does)."""
        self.table.waiting.remove(tracked)
        tracked.seq = Sequence(tracked.request, frozenset(), None, None)
        tracked.seq.keep_at = tracked.keep_at
        tracked.seq.prefilled = prefilled
        self.table.running[tracked.request.request_id] = tracked

    def waits(self, tracked: TrackedRequest, at: float | None = None) -> bool:
        return self.followers.waits(tracked, self.table, self.clock if at is None else at)


PROMPT = list(range(1000, 1400))


def test_a_follower_waits_until_the_kept_position_is_in():
    queue = Queue()
    leader, follower = queue.add("leader", PROMPT), queue.add("follower", PROMPT)
    assert not queue.waits(leader)  # the first has nobody to follow
    assert queue.waits(follower)  # waits for the leader, still queued
    assert leader.keep_at == {len(PROMPT) - 1}
    queue.start(leader, 0)
    assert leader.seq.keep_at == {len(PROMPT) - 1}
    leader.seq.prefilled = 256
    assert queue.waits(follower)
    leader.seq.prefilled = len(PROMPT) - 1
    assert not queue.waits(follower)
    assert not queue.waits(follower)  # and never again
    assert queue.counters.prefill_follows == {"served": 1}


def test_a_follower_whose_leader_is_past_the_shared_part_waits_for_its_prompts_end():
    """Caches that cut back: the copy at the leader's prompt end serves the shared part.
    Caches that cannot: nothing left to wait for, so it starts at once."""
    for cuts_back, waits, kept in [(True, True, {len(PROMPT) + 49}), (False, False, set())]:
        queue = Queue(cuts_back=cuts_back)
        leader = queue.add("leader", PROMPT + list(range(50)))
        queue.start(leader, 300)
        follower = queue.add("follower", PROMPT[:250] + [7] * 100)
        assert queue.waits(follower) is waits
        assert leader.seq.keep_at == kept


def test_a_short_shared_prefix_or_another_key_is_not_waited_for():
    queue = Queue()
    queue.start(queue.add("leader", PROMPT), 0)
    assert not queue.waits(queue.add("short", PROMPT[:99] + [1] * 300))
    assert not queue.waits(queue.add("other key", PROMPT, scope="key-b"))
    assert not queue.waits(queue.add("scored", PROMPT, prompt_logprobs=1))
    assert queue.waits(queue.add("same key", PROMPT))


def test_a_follower_stops_waiting_when_its_leader_stalls_or_leaves():
    queue = Queue(stall_seconds=30.0)
    leader = queue.add("leader", PROMPT)
    queue.start(leader, 0)
    follower = queue.add("follower", PROMPT)
    now = queue.clock
    assert queue.waits(follower, now)
    leader.seq.prefilled = 64
    assert queue.waits(follower, now + 25)  # it moved: the clock starts again
    assert queue.waits(follower, now + 50)
    assert not queue.waits(follower, now + 56)  # 31 s without a token prefilled
    assert queue.counters.prefill_follows == {"stalled": 1}

    second = queue.add("second", PROMPT)
    assert queue.waits(second)
    del queue.table.running["leader"]  # finished, cancelled or failed
    assert not queue.waits(second)
    assert queue.counters.prefill_follows == {"stalled": 1, "left": 1}


def test_a_follower_follows_the_leader_not_another_follower():
    queue = Queue()
    leader = queue.add("leader", PROMPT)
    queue.start(leader, 0)
    first, second = queue.add("first", PROMPT), queue.add("second", PROMPT)
    assert queue.waits(first) and queue.waits(second)
    assert first.following.leader is leader and second.following.leader is leader


def test_common_prefix_over_block_boundaries():
    base = list(range(5000))
    for cut in (0, 1, 1023, 1024, 1025, 4999):
        other = [*base[:cut], -1, *base[cut + 1 :]]
        assert common_prefix(base, other) == cut
    assert common_prefix(base, base) == 5000
    assert common_prefix(base, base[:3000]) == 3000
    assert common_prefix((), base) == 0
