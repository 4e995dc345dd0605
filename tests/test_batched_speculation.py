"""Speculation inside the continuous batch: every row drafts on its own (PLD from its
own n-gram index, the draft model batched over the rows), one target forward verifies
all rows, each row rolls back alone -- and every row's output is exactly what plain
decoding of that request alone gives."""

from __future__ import annotations

import asyncio
import zlib

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors

from engines.batched.costs import BatchCosts
from engines.batched.engine import BatchedSpeculativeEngine
from engines.gating.measured_costs import CostModel
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from engines.sample.sampling import RandomStream
from engines.sequence import FinishReason, make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from tests.distributions import assert_same_token_distribution

# Nearly flat verify costs (as for a tiny model): drafting pays at every batch size,
# so every test exercises batched verification.
COST = CostModel.assumed(9, per_token=0.02, draft_step=0.05)
GREEDY = SamplingParams(temperature=0.0)
CODE_PROMPT = "def add(a, b):\n    return a + b\n" * 4
PROMPTS = [
    "Once upon a time there was a robot",
    CODE_PROMPT,
    "Hello, world! How are you today?",
    "The weather in the mountains changes quickly",
    "import json, os, sys",
    "A stitch in time saves nine.",
    "Numbers: 0 1 2 3 4 5",
    "Please repeat the following text exactly",
]


def make_engines(target_dir, draft_dir=None, **config):
    """A batched speculative engine (and the single-stream engine it shares config,
    costs and gates with) on one registry, with the batched engine owning the model."""
    registry = ModelRegistry.load(str(target_dir), str(draft_dir) if draft_dir else None)
    spec = SpeculativeEngine(registry, SpecConfig(**config), cost=COST)
    batched = BatchedSpeculativeEngine(registry, spec.speculation, prefill_step_size=64)
    registry.transfer(batched.name)
    return spec, batched


@pytest.fixture(scope="module")
def perturbed(tiny_model_dir, perturbed_draft_dir):
    return make_engines(tiny_model_dir, perturbed_draft_dir)


@pytest.fixture(scope="module")
def self_draft(tiny_model_dir):
    return make_engines(tiny_model_dir, tiny_model_dir)


def repetitive_bias(tokenizer, n_tokens: int = 3) -> tuple:
    """Logit bias that makes the tiny model loop, so PLD has repeats to find."""
    ids = sorted(set(tokenizer.encode(CODE_PROMPT)))[:n_tokens]
    return tuple((t, 8.0) for t in ids)


def run_batch(
    engine,
    requests,
    join_after: dict | None = None,
    cancel_at: dict | None = None,
    rngs=None,
    results: list | None = None,
):
    """Step the engine until every sequence finished; `join_after[step]` lists requests
    added at that step, `cancel_at[step]` request ids cancelled before it; `rngs` gives
    some requests a fixed RNG; `results`, a list, collects each step's `StepResult`."""
    seqs = {}
    tokenizer = engine.registry.tokenizer
    for request in requests:
        seqs[request.request_id] = make_sequence(request, tokenizer)
        if rngs and request.request_id in rngs:
            seqs[request.request_id].rng = rngs[request.request_id]
        engine.admit(seqs[request.request_id])
    outputs: dict[str, list] = {rid: [] for rid in seqs}
    drafted_in_batch = 0
    step = 0
    while engine.batch_size or (join_after and any(s >= step for s in join_after)):
        for request in (join_after or {}).get(step, []):
            seqs[request.request_id] = make_sequence(request, tokenizer)
            outputs[request.request_id] = []
            engine.admit(seqs[request.request_id])
        for request_id in (cancel_at or {}).get(step, []):
            assert engine.cancel(request_id)
        result = engine.step()
        if results is not None:
            results.append(result)
        for output in result.outputs:
            outputs[output.request_id].append(output)
        drafted_in_batch += sum(d for rows, d in result.step_sizes if rows >= 2)
        step += 1
        assert step < 5000
    return seqs, outputs, drafted_in_batch


def greedy_request(rid, prompt_ids, max_tokens, **kw):
    return GenerationRequest(rid, tuple(prompt_ids), max_tokens, GREEDY, ignore_eos=True, **kw)


# ---- greedy exactness ---------------------------------------------------------------


def mixed_requests(reference, n: int):
    """n greedy rows taking turns: the draft model only, prompt lookup on output that
    loops, no drafting; each its own prompt (a ragged prefill) and length. Returns the
    requests and each one's solo mlx-lm decoding."""
    tokenizer = reference.tokenizer
    bias = repetitive_bias(tokenizer)
    requests, expected = [], {}
    for i in range(n):
        prompt = tokenizer.encode(PROMPTS[i])
        max_tokens = 30 + 11 * i
        sampling, processors = GREEDY, None
        if i % 3 == 0:  # the draft model only
            overrides = SpeculationOverrides(enable_pld=False)
        elif i % 3 == 1:  # PLD only, on output that loops
            overrides = SpeculationOverrides(enable_draft=False)
            sampling = SamplingParams(temperature=0.0, logit_bias=bias)
            processors = make_logits_processors(logit_bias=dict(bias))
        else:  # no drafting at all
            overrides = SpeculationOverrides(num_draft_tokens=0)
        rid = f"row{i}"
        requests.append(
            GenerationRequest(
                rid, tuple(prompt), max_tokens, sampling, ignore_eos=True, speculation=overrides
            )
        )
        kw = {"logits_processors": processors} if processors else {}
        expected[rid] = reference.greedy_tokens(prompt, max_tokens, **kw)
    return requests, expected


def assert_rows_equal(seqs: dict, outputs: dict, expected: dict[str, list[int]]) -> None:
    """Each row generated, and published, exactly its expected (solo) tokens."""
    for rid, seq in seqs.items():
        assert seq.generated == expected[rid], rid
        assert [t for o in outputs[rid] for t in o.token_ids] == expected[rid], rid


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_rows_mixing_pld_draft_and_plain_each_equal_solo_plain_decoding(perturbed, reference, n):
    _, engine = perturbed
    requests, expected = mixed_requests(reference, n)
    seqs, outputs, drafted = run_batch(engine, requests)
    assert_rows_equal(seqs, outputs, expected)
    assert drafted > 0, "rows drafted while batched"
    methods = {m for seq in seqs.values() for m in seq.spec.by_method}
    assert "draft" in methods
    if n >= 2:
        assert "pld" in methods
    assert not seqs["row2"].spec.by_method if n > 2 else True, "a k=0 row never drafts"


def test_rows_of_one_batch_roll_back_by_different_amounts(perturbed, reference):
    """A partial-acceptance draft: some verifies accept different counts per row."""
    _, engine = perturbed
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:4]]
    requests = [greedy_request(f"r{i}", p, 60) for i, p in enumerate(prompts)]
    seqs, _, _ = run_batch(engine, requests)
    for i, p in enumerate(prompts):
        assert seqs[f"r{i}"].generated == reference.greedy_tokens(p, 60)
    accepted = [seqs[f"r{i}"].spec.accepted_tokens for i in range(4)]
    drafted = [seqs[f"r{i}"].spec.draft_tokens for i in range(4)]
    assert all(d > 0 for d in drafted) and any(
        a < d for a, d in zip(accepted, drafted, strict=True)
    )


@pytest.mark.parametrize("max_tokens", [41, 42, 43])
def test_max_tokens_inside_an_accepted_run_is_exact_in_a_batch(self_draft, reference, max_tokens):
    _, engine = self_draft
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:2]]
    requests = [greedy_request("a", prompts[0], max_tokens), greedy_request("b", prompts[1], 50)]
    seqs, outputs, drafted = run_batch(engine, requests)
    assert seqs["a"].generated == reference.greedy_tokens(prompts[0], max_tokens)
    assert seqs["b"].generated == reference.greedy_tokens(prompts[1], 50)
    assert outputs["a"][-1].finish_reason == FinishReason.LENGTH
    assert max(len(o.token_ids) for o in outputs["a"]) > 1 and drafted > 0


def test_stop_string_inside_an_accepted_run_in_a_batch(self_draft, reference):
    _, engine = self_draft
    tokenizer = reference.tokenizer
    prompt = tokenizer.encode(PROMPTS[0])
    detok = tokenizer.detokenizer
    for token in reference.greedy_tokens(prompt, 80):
        detok.add_token(token)
    detok.finalize()
    full = detok.text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    other = tokenizer.encode(PROMPTS[2])
    requests = [
        greedy_request("a", prompt, 80, stop=(stop,)),
        greedy_request("b", other, 60),
    ]
    seqs, outputs, _ = run_batch(engine, requests)
    assert "".join(o.text for o in outputs["a"]) == full[: full.index(stop)]
    assert seqs["a"].matched_stop == stop
    assert [t for o in outputs["a"] for t in o.token_ids] == seqs["a"].generated
    assert seqs["b"].generated == reference.greedy_tokens(other, 60)


def test_eos_inside_an_accepted_run_in_a_batch(self_draft, reference):
    _, engine = self_draft
    prompt = reference.tokenizer.encode("Hello, world!")
    expected = reference.greedy_until_eos(prompt, 400)
    assert expected[-1] in reference.tokenizer.eos_token_ids
    other = reference.tokenizer.encode(PROMPTS[3])
    requests = [
        GenerationRequest("a", tuple(prompt), 400, GREEDY),
        greedy_request("b", other, 50),
    ]
    seqs, _, _ = run_batch(engine, requests)
    assert seqs["a"].generated == expected and seqs["a"].finish_reason == FinishReason.STOP
    assert seqs["b"].generated == reference.greedy_tokens(other, 50)


def test_rows_joining_and_cancelled_while_others_speculate_stay_exact(perturbed, reference):
    _, engine = perturbed
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:4]]
    first = [greedy_request("a", prompts[0], 70), greedy_request("b", prompts[1], 70)]
    joining = {4: [greedy_request("c", prompts[2], 40)], 9: [greedy_request("d", prompts[3], 30)]}
    seqs, _, drafted = run_batch(engine, first, join_after=joining, cancel_at={6: ["b"]})
    assert seqs["a"].generated == reference.greedy_tokens(prompts[0], 70)
    assert seqs["c"].generated == reference.greedy_tokens(prompts[2], 40)
    assert seqs["d"].generated == reference.greedy_tokens(prompts[3], 30)
    assert seqs["b"].finish_reason == FinishReason.CANCELLED
    assert seqs["b"].generated == reference.greedy_tokens(prompts[1], len(seqs["b"].generated))
    assert drafted > 0 and engine.batch_size == 0


def assert_seeded_rows_match_solo(spec, engine, reference, max_tokens: int = 40) -> dict:
    """Seeded rows drafting in a batch give the tokens each gives alone without
    drafting (a seeded token depends on seed and position only). Returns the rows."""
    registry = engine.registry
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:3]]
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=5)

    def seeded(rid, prompt, drafting):
        overrides = SpeculationOverrides() if drafting else SpeculationOverrides(num_draft_tokens=0)
        return GenerationRequest(
            rid, tuple(prompt), max_tokens, sampling, ignore_eos=True, speculation=overrides
        )

    registry.transfer(spec.name)
    solo = {}
    for i, prompt in enumerate(prompts):
        seq = make_sequence(seeded(f"s{i}", prompt, False), registry.tokenizer)
        spec.admit(seq)
        while spec.active is not None:
            spec.step()
        solo[f"s{i}"] = seq.generated
    registry.transfer(engine.name)
    seqs, _, _ = run_batch(engine, [seeded(f"s{i}", p, True) for i, p in enumerate(prompts)])
    for rid, tokens in solo.items():
        assert seqs[rid].generated == tokens, rid
    return seqs


async def assert_served_batch_is_exact_and_returns(scheduler, reference) -> None:
    """Three requests of different lengths through the scheduler: batched
    speculatively (rows roll back alone), each equal to mlx-lm, and the longest back
    in the single-stream engine once the others are done."""
    assert scheduler.rows_roll_back is True
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:3]]
    lengths = [120, 20, 25]
    streams = [
        scheduler.submit(greedy_request(f"h{i}", p, n))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    results = await asyncio.gather(*(s.collect() for s in streams))
    for prompt, n, events in zip(prompts, lengths, results, strict=True):
        assert [t for e in events for t in e.token_ids] == reference.greedy_tokens(prompt, n)
    assert isinstance(scheduler.batched_engine, BatchedSpeculativeEngine)
    switches = scheduler.counters.mode_switches
    assert switches.get(("batched", "speculative"), 0) >= 1, switches


def round_trip_through_the_batch(spec, engine, reference):
    """A greedy request decodes 20 tokens alone, joins the batch beside another until it
    has 55, leaves it (after a settle) and finishes alone: (its sequence, the state the
    batch handed back, the other request's sequence), both finished."""
    registry = engine.registry
    prompt = reference.tokenizer.encode(PROMPTS[0])
    seq = make_sequence(greedy_request("m", prompt, 90), registry.tokenizer)
    registry.transfer(spec.name)
    spec.admit(seq)
    while len(seq.generated) < 20:
        spec.step()
    state, _ = spec.hand_over("m")
    drafting = state.drafting  # the request's one drafting state, in every engine
    registry.transfer(engine.name)
    engine.take_over(state)
    assert [row.drafting for row in engine.rows if row.drafting is drafting]
    other = greedy_request("o", reference.tokenizer.encode(PROMPTS[1]), 30)
    other_seq = make_sequence(other, registry.tokenizer)
    engine.admit(other_seq)
    while len(seq.generated) < 55:
        engine.step()
    engine.settle()
    back, _ = engine.hand_over("m")
    assert back.cached == len(seq.all_tokens) - 1
    assert back.drafting is drafting
    registry.transfer(spec.name)
    spec.take_over(back)
    assert spec.active.drafting is drafting
    while spec.active is not None:
        spec.step()
    registry.transfer(engine.name)
    while engine.batch_size:
        engine.step()
    assert seq.generated == reference.greedy_tokens(prompt, 90)
    assert other_seq.generated == reference.greedy_tokens(other.prompt_tokens, 30)
    return seq, back, other_seq


def test_each_row_has_its_own_ngram_index(tiny_model_dir, reference):
    """PLD proposals come only from a row's own tokens, never another request's."""
    _, engine = make_engines(tiny_model_dir)
    tokenizer = reference.tokenizer
    a = tokenizer.encode(CODE_PROMPT)
    b = tokenizer.encode("zebra quokka narwhal axolotl")
    requests = [greedy_request("a", a, 20), greedy_request("b", b, 20)]
    seqs, _, _ = run_batch(engine, requests)
    assert seqs["a"].generated == reference.greedy_tokens(a, 20)
    assert seqs["b"].generated == reference.greedy_tokens(b, 20)
    rows_seen = {id(row.drafting.pld) for row in engine.rows}
    assert len(rows_seen) == len(engine.rows)


def test_the_batch_checks_its_predictions_against_what_steps_commit(tiny_model_dir, reference):
    """With costs learned while serving, every verify's real tokens and seconds are kept
    beside its prediction, by batch size and kind of step -- plain steps included, the
    rate drafting has to beat -- and the output stays exact."""
    registry = ModelRegistry.load(str(tiny_model_dir))
    spec = SpeculativeEngine(registry, SpecConfig(), cost=COST)
    costs = BatchCosts(COST)
    engine = BatchedSpeculativeEngine(registry, spec.speculation, prefill_step_size=64, costs=costs)
    registry.transfer(engine.name)
    tokenizer = reference.tokenizer
    bias = repetitive_bias(tokenizer)
    processors = make_logits_processors(logit_bias=dict(bias))
    prompts = [tokenizer.encode(p) for p in (CODE_PROMPT, PROMPTS[0])]
    requests = [
        GenerationRequest(
            f"loop{i}",
            tuple(p),
            80,
            SamplingParams(temperature=0.0, logit_bias=bias),
            ignore_eos=True,
        )
        for i, p in enumerate(prompts)
    ]
    seqs, _, _ = run_batch(engine, requests)
    for request, prompt in zip(requests, prompts, strict=True):
        expected = reference.greedy_tokens(prompt, 80, logits_processors=processors)
        assert seqs[request.request_id].generated == expected
    plain, lookup = costs.outcomes[(2, "plain")], costs.outcomes[(2, "lookup")]
    assert plain.steps >= costs.min_samples, "plain steps are measured beside drafting"
    assert plain.averages[0] == pytest.approx(2.0), "a plain step commits one token per row"
    assert lookup.steps > 0 and lookup.averages[0] > 2.0
    assert costs.as_dict()["calibration_by_rows"]["2/lookup"] == pytest.approx(
        costs.calibration(2, "lookup"), abs=1e-3
    )


# ---- sampled distribution ------------------------------------------------------------


def _first_two(engine, prompt_ids, seeds, spec: bool, batch: int = 16):
    """First two tokens of unseeded sampled requests (the Leviathan rule), each RNG
    started from a fixed key so the test is repeatable, `batch` rows at a time."""
    overrides = SpeculationOverrides() if spec else SpeculationOverrides(num_draft_tokens=0)
    pairs = []
    for start in range(0, len(seeds), batch):
        requests = [
            GenerationRequest(
                f"s{seed}",
                tuple(prompt_ids),
                2,
                SamplingParams(temperature=0.8, top_k=6),
                ignore_eos=True,
                speculation=overrides,
            )
            for seed in seeds[start : start + batch]
        ]
        rngs = {
            f"s{seed}": RandomStream(mx.random.key(seed)) for seed in seeds[start : start + batch]
        }
        seqs, _, _ = run_batch(engine, requests, rngs=rngs)
        pairs += [tuple(seqs[r.request_id].generated) for r in requests]
    return pairs


def test_sampled_rows_in_a_batch_match_plain_sampling_distribution(perturbed, reference):
    _, engine = perturbed
    prompt = reference.tokenizer.encode(PROMPTS[0])
    base = zlib.crc32(b"batched-sampled") % 10_000
    trials = 1200
    spec = _first_two(engine, prompt, [base + i for i in range(trials)], spec=True)
    plain = _first_two(engine, prompt, [base + trials + i for i in range(trials)], spec=False)
    assert_same_token_distribution(spec, plain)


def test_seeded_rows_give_their_solo_plain_seeded_tokens_in_any_batch(perturbed, reference):
    """A seeded request's tokens depend on (seed, position) only: the same with or
    without drafting, alone or beside other rows."""
    _, engine = perturbed
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:4]]

    def seeded(rid, prompt, k=None):
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=77)
        overrides = SpeculationOverrides(num_draft_tokens=k)
        return GenerationRequest(
            rid, tuple(prompt), 50, params, ignore_eos=True, speculation=overrides
        )

    alone, _, _ = run_batch(engine, [seeded("a", prompts[0], k=0)])
    crowd = [seeded("a", prompts[0])] + [
        greedy_request(f"o{i}", p, 40 + 5 * i) for i, p in enumerate(prompts[1:])
    ]
    together, _, drafted = run_batch(engine, crowd)
    assert together["a"].generated == alone["a"].generated
    assert together["a"].spec.draft_tokens > 0 and drafted > 0


def test_a_short_prompt_starts_decoding_while_a_long_one_still_prefills(perturbed, reference):
    """Newcomers prefill together a chunk per step; a row whose prompt is done joins
    the batch at once instead of waiting for the longest prompt of its group."""
    _, engine = perturbed  # prefill chunks of 64 tokens
    long_prompt = reference.tokenizer.encode(CODE_PROMPT * 6)
    short_prompt = reference.tokenizer.encode(PROMPTS[0])
    assert len(long_prompt) > 4 * 64
    tokenizer = reference.tokenizer
    seqs = {
        "long": make_sequence(greedy_request("long", long_prompt, 20), tokenizer),
        "short": make_sequence(greedy_request("short", short_prompt, 20), tokenizer),
    }
    for seq in seqs.values():
        engine.admit(seq)
    first = engine.step().outputs
    assert [o.request_id for o in first] == ["short"], "the short prompt decodes at once"
    assert not seqs["long"].generated
    while engine.batch_size:
        engine.step()
    assert seqs["short"].generated == reference.greedy_tokens(short_prompt, 20)
    assert seqs["long"].generated == reference.greedy_tokens(long_prompt, 20)


def test_a_burst_of_long_prompts_prefills_one_by_one_shortest_first(perturbed, reference):
    """Rows of one prefill forward are padded to the longest, so long prompts do not
    share a group: each prefills alone, the one with least left first, and gets its
    first token as soon as its own prompt is in -- not when the whole burst is.
    Short prompts still share one forward. Every output equals solo decoding."""
    _, engine = perturbed  # prefill chunks of 64 tokens
    tokenizer = reference.tokenizer
    prompts = {
        "long": tokenizer.encode(CODE_PROMPT * 3),
        "longer": tokenizer.encode(CODE_PROMPT * 4),
        "medium": tokenizer.encode(CODE_PROMPT * 2),
        "short1": tokenizer.encode(PROMPTS[0]),
        "short2": tokenizer.encode(PROMPTS[2]),
    }
    assert len(prompts["medium"]) > 64 // 2 and len(prompts["short2"]) < 64 // 2
    seqs = {
        rid: make_sequence(greedy_request(rid, ids, 8), tokenizer) for rid, ids in prompts.items()
    }
    for seq in seqs.values():
        engine.admit(seq)
    assert [[r.seq.request_id for r in g.rows] for g in engine.groups] == [
        ["long"],
        ["longer"],
        ["medium"],
        ["short1", "short2"],
    ]
    first_token_order = []
    while engine.batch_size:
        for output in engine.step().outputs:
            if output.token_ids and output.request_id not in first_token_order:
                first_token_order.append(output.request_id)
    assert set(first_token_order[:2]) == {"short1", "short2"}, "short prompts first"
    assert first_token_order[2:] == ["medium", "long", "longer"]
    for rid, ids in prompts.items():
        assert seqs[rid].generated == reference.greedy_tokens(ids, 8), rid
