"""A request arriving while another of its API key decodes the same prompt starts from
a copy of that request's cache, instead of prefilling the prompt again: an agent's
subagents, or a retry after a client timeout, arrive while the first answer is being
written, and the finished request's cache reaches the prefix cache only at its end.

The engines hand out a copy of a decoding sequence's cache (`Engine.copy_cache`) that
its own later steps cannot reach; the scheduler asks for it when a newcomer of the key
shares enough of the prompt (`PrefillFollowers`), never across keys. Outputs stay
exactly mlx-lm's."""

from __future__ import annotations

import asyncio

import pytest

from engines.request import common_prefix
from engines.sequence import make_sequence
from scheduler.prefix_cache import PrefixCache
from scheduler.prefix_reuse import PrefixReuse
from tests.test_batched_speculation import greedy_request, make_engines
from tests.test_prefill_followers import PROMPT, Queue, prompt_of, tokens_of

CHUNK = 64
LONG = 400  # the leader's answer: long enough to still be decoding when others arrive


def keyed(rid: str, prompt: list[int], scope: str = "key-a", max_tokens: int = 8):
    return greedy_request(rid, prompt, max_tokens, cache_scope=scope)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return make_engines(tiny_model_dir, prefill_step_size=CHUNK)


def run(engine, tokens: list[int] | None = None) -> list[int]:
    tokens = [] if tokens is None else tokens
    while engine.active_ids:
        tokens += [t for o in engine.step().outputs for t in o.token_ids]
    return tokens


def decoding_leader(pair, which: str, reference, generated: int):
    """The engine `which` of `pair` (single or batched) decoding a 40-token answer to a
    300-token prompt, `generated` of its tokens out: (engine, sequence, tokens)."""
    spec, batched = pair
    engine = spec if which == "single" else batched
    engine.registry.transfer(engine.name)
    prompt = prompt_of(reference, 300)
    seq = make_sequence(greedy_request("leader", prompt, 40), reference.tokenizer)
    engine.admit(seq)
    assert engine.copy_cache("leader") is None  # nothing prefilled yet
    tokens: list[int] = []
    while len(tokens) < generated:
        tokens += [t for o in engine.step().outputs for t in o.token_ids]
    return engine, seq, tokens


@pytest.mark.parametrize("which", ["single", "batched"])
def test_an_engine_copies_a_decoding_sequences_cache(engines, reference, which):
    """Mid-decode (a step possibly in flight), the copy holds exactly the committed
    tokens it says; the leader's later steps do not reach it (the leader's own answer
    and the answer started from the copy afterwards are both mlx-lm's), and a sequence
    still prefilling hands out none."""
    engine, seq, tokens = decoding_leader(engines, which, reference, 5)
    prompt, max_tokens = list(seq.request.prompt_tokens), seq.request.max_tokens
    assert engine.copy_cache("nobody") is None
    copy = engine.copy_cache("leader")
    assert copy is not None and copy.seq is seq
    assert len(prompt) + len(seq.generated) - 1 <= copy.cached <= len(seq.all_tokens)
    copied_tokens = seq.all_tokens[: copy.cached]
    assert run(engine, tokens) == reference.greedy_tokens(prompt, max_tokens)

    reuse = PrefixReuse(PrefixCache())
    reuse.keep([], [copy])
    # the copy serves what another prompt shares with it, cut back by the lookup
    other = prompt[:250] + prompt_of(reference, 41, "x = [i * i for i in range(9)]\n")[1:]
    follower = make_sequence(greedy_request("follower", other, 12), reference.tokenizer)
    start = reuse.start(follower, engine.registry.target.model)
    assert start.cached == common_prefix(other, copied_tokens) == 250
    engine.admit(start)
    assert run(engine) == reference.greedy_tokens(other, 12)
    # and the prompt and answer it holds, further along
    longer = copied_tokens + prompt_of(reference, 21, "print('more')\n")[1:]
    again = make_sequence(greedy_request("again", longer, 12), reference.tokenizer)
    start = reuse.start(again, engine.registry.target.model)
    assert start.cached == copy.cached
    engine.admit(start)
    assert run(engine) == reference.greedy_tokens(longer, 12)


@pytest.fixture(scope="module")
def drafting(tiny_model_dir, perturbed_draft_dir):
    return make_engines(tiny_model_dir, perturbed_draft_dir, prefill_step_size=CHUNK)


@pytest.mark.parametrize("which", ["single", "batched"])
def test_the_copy_carries_the_draft_models_cache(drafting, reference, which):
    """With a draft model, the copy holds the draft's cache too, so the request
    started from it drafts at once instead of feeding the draft the whole prompt first;
    both answers still mlx-lm's."""
    engine, seq, tokens = decoding_leader(drafting, which, reference, 12)
    prompt, max_tokens = list(seq.request.prompt_tokens), seq.request.max_tokens
    copy = engine.copy_cache("leader")
    assert copy is not None and copy.drafting.draft is not None
    assert len(copy.drafting.draft.fed) >= len(prompt)
    copied_tokens = seq.all_tokens[: copy.cached]
    assert run(engine, tokens) == reference.greedy_tokens(prompt, max_tokens)

    reuse = PrefixReuse(PrefixCache())
    reuse.keep([], [copy])
    longer = copied_tokens + prompt_of(reference, 21, "print('more')\n")[1:]
    again = make_sequence(greedy_request("again", longer, 12), reference.tokenizer)
    start = reuse.start(again, engine.registry.target.model)
    assert start.cached >= len(prompt)
    assert start.drafting.draft is not None and start.drafting.draft.fed == longer[: start.cached]
    engine.admit(start)
    assert run(engine) == reference.greedy_tokens(longer, 12)


async def until_first_token(stream) -> list:
    return [await asyncio.wait_for(stream.__anext__(), 60)]


async def rest(stream, events: list) -> list:
    return events + await asyncio.wait_for(stream.collect(), 120)


@pytest.fixture
def scheduler(follow_scheduler):
    return follow_scheduler


async def test_a_newcomer_starts_from_the_decoding_leaders_cache(scheduler, reference):
    """The key's next two requests arrive while the first decodes its answer (single-
    stream engine): they start with the whole shared prompt cached, from one copy of the
    leader's cache; another key's identical prompt starts from nothing. All exact."""
    prompt = prompt_of(reference, 300)
    leader = scheduler.submit(keyed("leader", prompt, max_tokens=LONG))
    first = await until_first_token(leader)
    assert scheduler.counters.prefill_follows == {}
    other_key = scheduler.submit(keyed("other-key", prompt, "key-b"))
    followers = [scheduler.submit(keyed(f"follower-{i}", prompt)) for i in range(2)]
    a, b, *c = await asyncio.gather(
        rest(leader, first), other_key.collect(), *(f.collect() for f in followers)
    )
    assert tokens_of(a) == reference.greedy_tokens(prompt, LONG)
    expected = reference.greedy_tokens(prompt, 8)
    assert tokens_of(b) == tokens_of(c[0]) == tokens_of(c[1]) == expected
    assert b[-1].cached_tokens == 0
    # only the newest token fed, both from one copy (the second found the first's)
    assert c[0][-1].cached_tokens == c[1][-1].cached_tokens == len(prompt) - 1
    assert scheduler.counters.prefill_follows == {"copied": 1}


async def test_a_newcomer_starts_from_a_batched_leaders_cache(scheduler, reference):
    """The leader decodes in the batched engine beside another key's request; the key's
    newcomer shares 200 tokens of its prompt and starts at exactly those, all exact."""
    shared = prompt_of(reference, 200)
    one = shared + prompt_of(reference, 61, "print('one')\n")[1:]  # without BOS
    two = shared + prompt_of(reference, 71, "while True:\n    pass\n")[1:]
    story = prompt_of(reference, 120, "Once upon a time there was a robot. ")
    neighbour = scheduler.submit(keyed("neighbour", story, "key-b", max_tokens=LONG))
    leader = scheduler.submit(keyed("leader", one, max_tokens=LONG))
    first = await until_first_token(leader)
    assert scheduler.mode.value == "batched"
    follower = scheduler.submit(keyed("follower", two))
    n, a, b = await asyncio.gather(neighbour.collect(), rest(leader, first), follower.collect())
    assert tokens_of(n) == reference.greedy_tokens(story, LONG)
    assert tokens_of(a) == reference.greedy_tokens(one, LONG)
    assert tokens_of(b) == reference.greedy_tokens(two, 8)
    assert b[-1].cached_tokens == 200
    assert scheduler.counters.prefill_follows == {"copied": 1}


async def test_a_short_shared_prefix_is_not_copied(scheduler, reference):
    """Sharing fewer tokens than `--prefill-follow-min-tokens` (100 here) is prefilled
    again: no copy of the leader's cache is made for it."""
    prompt = prompt_of(reference, 300)
    leader = scheduler.submit(keyed("leader", prompt, max_tokens=LONG))
    first = await until_first_token(leader)
    short = prompt[:60] + prompt_of(reference, 200, "Once upon a time there was a cat. ")[1:]
    newcomer = scheduler.submit(keyed("newcomer", short))
    a, b = await asyncio.gather(rest(leader, first), newcomer.collect())
    assert tokens_of(a) == reference.greedy_tokens(prompt, LONG)
    assert tokens_of(b) == reference.greedy_tokens(short, 8)
    assert b[-1].cached_tokens == 0
    assert scheduler.counters.prefill_follows == {}


@pytest.mark.parametrize(
    ("cuts_back", "handed", "asked", "counted"),
    [
        (True, True, ["leader"], {"copied": 1}),
        (True, False, ["leader"], {}),
        (False, True, [], {}),
    ],
)
def test_a_decoding_leader_is_copied_not_waited_for(cuts_back, handed, asked, counted):
    """Caches that cut back: the engine is asked for a copy and the newcomer starts at
    once. Caches that cannot (a copy of prompt and answer cannot be cut back to the
    prompt), or an engine that hands none out: it starts at once, nothing counted."""
    queue = Queue(cuts_back=cuts_back)
    calls: list[str] = []

    def copy_running(leader) -> bool:
        calls.append(leader.request.request_id)
        return handed

    queue.followers.copy_running = copy_running
    leader = queue.add("leader", PROMPT)
    queue.start(leader, len(PROMPT) - 1)
    leader.first_token = queue.clock
    follower = queue.add("follower", PROMPT)
    assert not queue.waits(follower)
    assert follower.following is None
    assert calls == asked
    assert queue.counters.prefill_follows == counted
