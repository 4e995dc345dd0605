"""Suffix decoding through the real engines, scheduler and HTTP stack: a request drafts
from its own API key's earlier requests (`engines.drafting.suffix`,
`scheduler.suffix_store`), never another key's; greedy output stays token-identical to
plain decoding and sampled output exact in distribution, in the single-stream and the
batched engine; /metrics and /v1/stats show the method and the index's size."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engines.batched.engine import BatchedSpeculativeEngine
from engines.drafting.draft import SUFFIX
from engines.drafting.suffix import SuffixIndex, SuffixReader
from engines.gating.measured_costs import CostModel
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from engines.sample.sampling import RandomStream
from engines.sequence import make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from engines.telemetry import SpecStats
from scheduler.suffix_store import PROMPT_TAIL, SuffixStore
from tests.conftest import make_client, start_scheduler
from tests.distributions import assert_same_token_distribution
from tests.test_metrics import samples, value

COST = CostModel.assumed(9)
BATCH_COST = CostModel.assumed(9, per_token=0.02, draft_step=0.05)
GREEDY = SamplingParams(temperature=0.0)
QUESTION = "Once upon a time there was a little robot who loved to read books. Why?"


def make_engine(target_dir) -> SpeculativeEngine:
    registry = ModelRegistry.load(str(target_dir), None)
    engine = SpeculativeEngine(registry, SpecConfig(), cost=COST)
    registry.transfer(engine.name)
    return engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def serve(engine, prompt, max_tokens, index=None, sampling=GREEDY, rng=None, **kw):
    """One request through the single-stream engine, drafting from `index` if given."""
    request = GenerationRequest("r", tuple(prompt), max_tokens, sampling, ignore_eos=True, **kw)
    seq = make_sequence(request, engine.registry.tokenizer)
    seq.suffix = SuffixReader(index) if index is not None else None
    if rng is not None:
        seq.rng = rng
    engine.admit(seq)
    while engine.active is not None:
        engine.step()
    return seq


def suffix_stats(seq):
    return seq.spec.by_method.get(SUFFIX)


def test_the_same_prompt_again_drafts_the_earlier_answer_and_equals_plain(engine, reference):
    prompt = reference.tokenizer.encode(QUESTION)
    expected = reference.greedy_tokens(prompt, 64)
    index = SuffixIndex()
    first = serve(engine, prompt, 64, index)
    assert first.generated == expected
    assert suffix_stats(first) is None  # an empty index proposes nothing
    index.add(first.all_tokens)
    again = serve(engine, prompt, 64, index)
    assert again.generated == expected
    stats = suffix_stats(again)
    assert stats is not None and stats.accepted_tokens >= 48, stats
    assert stats.accepted_tokens == stats.draft_tokens  # the same model, the same answer
    assert stats.drafts <= 8  # long drafts: about 64 tokens in a handful of verifies


def test_a_wrong_earlier_answer_is_rejected_and_the_output_stays_plain(engine, reference):
    prompt = reference.tokenizer.encode(QUESTION)
    expected = reference.greedy_tokens(prompt, 40)
    wrong = [(t + 7) % 500 + 20 for t in expected]  # another continuation of the prompt
    index = SuffixIndex()
    index.add([*prompt, *wrong])
    seq = serve(engine, prompt, 40, index)
    assert seq.generated == expected
    stats = suffix_stats(seq)
    assert stats is not None and stats.drafts >= 1
    assert stats.accepted_tokens < stats.draft_tokens


def test_a_partly_right_earlier_answer_is_accepted_up_to_where_it_differs(engine, reference):
    prompt = reference.tokenizer.encode(QUESTION)
    expected = reference.greedy_tokens(prompt, 48)
    earlier = [*expected[:20], (expected[20] + 1) % 500 + 20, *expected[21:]]
    index = SuffixIndex()
    index.add([*prompt, *earlier])
    seq = serve(engine, prompt, 48, index)
    assert seq.generated == expected
    stats = suffix_stats(seq)
    assert stats.accepted_tokens >= 20 and stats.accepted_tokens < stats.draft_tokens


def first_tokens(engine, prompt, trials, index, spec: bool) -> list[tuple[int, ...]]:
    overrides = SpeculationOverrides() if spec else SpeculationOverrides(num_draft_tokens=0)
    pairs = []
    for seed in range(trials):
        rng = RandomStream(mx.random.key(seed + (0 if spec else trials)))
        params = SamplingParams(temperature=0.8, top_k=6)
        seq = serve(engine, prompt, 3, index, params, rng, speculation=overrides)
        pairs.append(tuple(seq.generated))
    return pairs


@pytest.mark.slow
def test_sampled_first_tokens_with_suffix_drafts_match_plain_distribution(
    tiny_model_dir, reference
):
    """Unseeded sampling: suffix drafts (one-hot q) pass the Leviathan rule, so the
    tokens' distribution is plain sampling's."""
    engine = make_engine(tiny_model_dir)
    prompt = reference.tokenizer.encode(QUESTION)
    index = SuffixIndex()
    index.add([*prompt, *reference.greedy_tokens(prompt, 8)])  # the likeliest answer
    trials = 1200
    spec = first_tokens(engine, prompt, trials, index, spec=True)
    plain = first_tokens(engine, prompt, trials, index, spec=False)
    assert_same_token_distribution(spec, plain)
    stats = engine.totals.by_method[SUFFIX]
    assert stats.accepted_tokens > 0 and stats.accepted_tokens < stats.draft_tokens


def test_batched_rows_draft_from_their_own_keys_index_only(tiny_model_dir, reference):
    """Two rows ask the same question: the row whose key asked it before drafts the
    earlier answer; the other key's row, whose index is empty, drafts nothing from it.
    Both outputs equal plain decoding."""
    registry = ModelRegistry.load(str(tiny_model_dir), None)
    spec = SpeculativeEngine(registry, SpecConfig(), cost=BATCH_COST)
    batched = BatchedSpeculativeEngine(registry, spec.speculation, prefill_step_size=64)
    registry.transfer(batched.name)
    prompt = reference.tokenizer.encode(QUESTION)
    expected = reference.greedy_tokens(prompt, 48)
    mine, theirs = SuffixIndex(), SuffixIndex()
    mine.add([*prompt, *expected])
    seqs = {}
    for rid, index in (("a", mine), ("b", theirs)):
        request = GenerationRequest(rid, tuple(prompt), 48, GREEDY, ignore_eos=True)
        seqs[rid] = make_sequence(request, registry.tokenizer)
        seqs[rid].suffix = SuffixReader(index)
        batched.admit(seqs[rid])
    steps = 0
    while batched.batch_size:
        batched.step()
        steps += 1
        assert steps < 500
    assert seqs["a"].generated == expected and seqs["b"].generated == expected
    assert suffix_stats(seqs["a"]).accepted_tokens >= 24
    assert suffix_stats(seqs["b"]) is None


def test_the_store_keeps_each_keys_own_index_bounded():
    store = SuffixStore(tokens_per_key=40, max_keys=2)

    class Seq:  # what `learn` reads of a finished sequence
        def __init__(self, scope, tokens, prompt=4):
            self.request = GenerationRequest(
                "x", tuple(tokens[:prompt]), 1, GREEDY, cache_scope=scope
            )
            self.generated = tokens[prompt:]
            self.spec = SpecStats()

    a, b = store.reader("A"), store.reader("B")
    store.learn(Seq("A", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]))
    assert a.propose([1, 2, 3], 2).tokens == [4, 5]
    assert b.propose([1, 2, 3], 2) is None  # B's index never sees A's requests
    for i in range(10):  # B's traffic fills B's own bound, not A's
        store.learn(Seq("B", [100 + i] * 2 + list(range(200 + 10 * i, 208 + 10 * i))))
    assert a.propose([1, 2, 3], 2).tokens == [4, 5]
    assert store.indexes["B"].tokens <= 40 and store.indexes["B"].evicted > 0
    store.reader("C")  # a third key retires the least recently used one (A)
    assert list(store.indexes) == ["B", "C"]
    stats = store.stats()
    assert stats["keys"] == 2 and stats["retired_keys"] == 1 and stats["tokens"] <= 40
    assert SuffixStore(tokens_per_key=0).reader("A") is None
    # a long prompt (an agent's history) is indexed by its last PROMPT_TAIL tokens only
    agent = SuffixStore(tokens_per_key=10_000)
    agent.learn(Seq("A", list(range(1000, 3000)), prompt=1900))
    assert agent.stats()["tokens"] == PROMPT_TAIL + 100
    assert agent.reader("A").propose([2890, 2891], 3).tokens == [2892, 2893]
    assert agent.reader("A").propose([1000, 1001], 3) is None
    # and its suffix drafts' verifies teach the key's index how far to trust itself
    wrong = Seq("A", [7, 8, 9, 10, 11])
    wrong.spec.record(SUFFIX, 4, 0)
    wrong.spec.record(SUFFIX, 4, 2)
    agent.learn(wrong)
    assert (agent.indexes["A"].drafts, agent.indexes["A"].first_accepted) == (2, 1)


async def test_another_key_asking_the_same_gets_no_suffix_drafts(tiny_model_dir, reference):
    """Key A asks a question; key B asks the same: B's request drafts nothing from the
    suffix indexes (a faster answer would tell B what A asked). A asking again in a new
    conversation drafts its earlier answer, accepted in full; all three are identical.
    /metrics and /v1/stats show the method and the indexes' size, and the response's
    token sources tag the tokens the suffix drafts gave."""
    scheduler = start_scheduler(tiny_model_dir, prefix_cache_entries=0)
    try:
        async with make_client(scheduler, api_keys=("key-a", "key-b")) as client:

            async def ask(key: str, **overrides) -> dict:
                response = await client.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": QUESTION}],
                        "max_tokens": 48,
                        "temperature": 0,
                        "ignore_eos": True,
                        "tandem_token_sources": True,
                        **overrides,
                    },
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert response.status_code == 200, response.text
                return response.json()

            first = await ask("key-a")
            other = await ask("key-b")
            again = await ask("key-a")
            auth = {"Authorization": "Bearer key-a"}
            stats = (await client.get("/v1/stats", headers=auth)).json()
            metrics = (await client.get("/metrics", headers=auth)).text
            no_lookup = await ask("key-a", enable_pld=False)  # a request's own switch
    finally:
        scheduler.stop()
    text = first["choices"][0]["message"]["content"]
    assert other["choices"][0]["message"]["content"] == text
    assert again["choices"][0]["message"]["content"] == text
    assert SUFFIX not in first["speculation"]["by_method"]
    assert SUFFIX not in other["speculation"]["by_method"], "B drafted from A's requests"
    suffix = again["speculation"]["by_method"][SUFFIX]
    assert suffix["accepted_tokens"] >= 40 and suffix["accepted_tokens"] == suffix["draft_tokens"]
    sources = [token["source"] for token in again["token_sources"]]
    assert sources.count(SUFFIX) == suffix["accepted_tokens"]
    assert SUFFIX not in {token["source"] for token in other["token_sources"]}
    assert SUFFIX not in no_lookup["speculation"]["by_method"]
    assert no_lookup["choices"][0]["message"]["content"] == text
    index = stats["speculation"]["suffix_index"]
    assert index["keys"] == 2 and index["sequences"] == 3 and index["tokens"] > 3 * 48
    assert stats["speculation"]["by_method"][SUFFIX]["accepted_tokens"] == suffix["accepted_tokens"]
    assert "suffix" in stats["speculation"]["drafters"]
    scraped = samples(metrics)
    accepted = value(scraped, "tandem_spec_accepted_tokens_total", method=SUFFIX)
    assert accepted == suffix["accepted_tokens"]
    assert value(scraped, "tandem_suffix_index", kind="sequences") == 3
    assert value(scraped, "tandem_suffix_index", kind="tokens") == index["tokens"]
    assert value(scraped, "tandem_suffix_index", kind="bytes") == index["bytes"] > 0
    assert value(scraped, "tandem_drafter_active", drafter=SUFFIX) == 1.0
