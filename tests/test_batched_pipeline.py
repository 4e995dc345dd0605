"""Plain batched steps queued one ahead: the next forward runs while this step's tokens
are committed and published, and every row still gets exactly its solo plain output,
whatever happens mid-pipeline (rows finishing, cancelled, leaving, joining)."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engines.batched.costs import MODEL, BatchCosts
from engines.batched.engine import BatchedSpeculativeEngine
from engines.gating.measured_costs import CostModel
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams
from engines.sequence import FinishReason, make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from tests.distributions import assert_same_token_distribution
from tests.test_batched_speculation import PROMPTS, greedy_request

COST = CostModel.assumed(9, per_token=0.02, draft_step=0.05)
GREEDY_ = SamplingParams(temperature=0.0)


def plain_engines(model_dir, **config):
    """Engines with drafting off by default: every batched step is plain."""
    config = {"num_draft_tokens": 0, "enable_pld": False, **config}
    registry = ModelRegistry.load(str(model_dir))
    spec = SpeculativeEngine(registry, SpecConfig(**config), cost=COST)
    batched = BatchedSpeculativeEngine(registry, spec.speculation, prefill_step_size=64)
    registry.transfer(batched.name)
    return spec, batched


def drive(engine, requests, before_step=None, eos=None, on_result=None):
    """Step until every sequence finished; `before_step(step, seqs)` may act between
    steps (cancel, settle and hand over, take over); `eos[request_id]` replaces a
    request's end-of-sequence tokens; `on_result` sees each step's `StepResult`.
    Returns (seqs, published tokens per request, steps that left a plain step in
    flight)."""
    tokenizer = engine.registry.tokenizer
    seqs = {r.request_id: make_sequence(r, tokenizer) for r in requests}
    for request_id, tokens in (eos or {}).items():
        seqs[request_id].eos_token_ids = frozenset(tokens)
    for seq in seqs.values():
        engine.admit(seq)
    published = {rid: [] for rid in seqs}
    pipelined = step = 0
    while engine.batch_size:
        if before_step is not None:
            for output in before_step(step, seqs) or []:
                published.setdefault(output.request_id, []).extend(output.token_ids)
        result = engine.step()
        if on_result is not None:
            on_result(result)
        for output in result.outputs:
            published.setdefault(output.request_id, []).extend(output.token_ids)
        pipelined += engine.in_flight is not None
        step += 1
        assert step < 2000
    return seqs, published, pipelined


def test_plain_batched_steps_are_queued_ahead_and_each_row_equals_solo_decoding(
    tiny_model_dir, reference
):
    _, engine = plain_engines(tiny_model_dir)
    tokenizer = reference.tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS[:5]]
    requests = [greedy_request(f"r{i}", p, 17 + 9 * i) for i, p in enumerate(prompts)]
    seqs, published, pipelined = drive(engine, requests)
    for i, request in enumerate(requests):
        expected = reference.greedy_tokens(prompts[i], request.max_tokens)
        assert seqs[request.request_id].generated == expected
        assert published[request.request_id] == expected, "every token published once"
    assert pipelined > 40, "plain steps ran with the next one in flight"
    assert engine.in_flight is None and not engine.rows


def test_rows_finishing_mid_pipeline_leave_caches_of_exactly_their_tokens(
    tiny_model_dir, reference
):
    """EOS, a stop string and max_tokens end rows while the next step is in flight:
    nothing after the end is committed, and each released cache holds exactly the
    KV of its committed tokens (what the prefix cache stores)."""
    _, engine = plain_engines(tiny_model_dir)
    tokenizer = reference.tokenizer
    prompt = tokenizer.encode(PROMPTS[0])
    solo = reference.greedy_tokens(prompt, 40)
    stop_text = tokenizer.decode(solo[10:12])
    requests = [
        GenerationRequest("stop", tuple(prompt), 40, GREEDY_, ignore_eos=True, stop=(stop_text,)),
        greedy_request("length", prompt, 9),
        GenerationRequest("eos", tuple(prompt), 40, GREEDY_),  # its EOS: solo[14]
        greedy_request("long", tokenizer.encode(PROMPTS[2]), 30),
    ]
    released = []
    seqs, published, pipelined = drive(
        engine, requests, eos={"eos": [solo[14]]}, on_result=lambda r: released.extend(r.released)
    )
    assert seqs["eos"].finish_reason == FinishReason.STOP
    assert seqs["eos"].generated == solo[: solo.index(solo[14]) + 1] == published["eos"]
    assert seqs["stop"].finish_reason == FinishReason.STOP and seqs["stop"].matched_stop
    assert seqs["stop"].generated == solo[: len(seqs["stop"].generated)]
    assert seqs["length"].generated == solo[:9]
    assert seqs["long"].generated == reference.greedy_tokens(tokenizer.encode(PROMPTS[2]), 30)
    assert pipelined > 5
    assert {state.seq.request_id for state in released} == set(seqs)
    for state in released:
        tokens = state.seq.all_tokens
        assert state.cached <= len(tokens)
        assert all(layer.offset == state.cached for layer in state.cache)
        fresh = make_prompt_cache(reference.model)
        reference.model(mx.array(tokens[: state.cached])[None], cache=fresh)
        assert mx.allclose(state.cache[0].keys, fresh[0].keys[..., : state.cached, :], atol=1e-4)


def test_a_row_cancelled_mid_pipeline_leaves_the_others_exact(tiny_model_dir, reference):
    _, engine = plain_engines(tiny_model_dir)
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:3]]
    requests = [greedy_request(f"r{i}", p, 40) for i, p in enumerate(prompts)]

    def cancel(step, seqs):
        if step == 12:
            assert engine.in_flight is not None
            assert engine.cancel("r1")

    seqs, _, _ = drive(engine, requests, cancel)
    assert seqs["r1"].finish_reason == FinishReason.CANCELLED
    for i in (0, 2):
        assert seqs[f"r{i}"].generated == reference.greedy_tokens(prompts[i], 40)


def test_a_row_leaving_mid_pipeline_settles_and_continues_exactly_alone(tiny_model_dir, reference):
    """`settle` commits the step in flight (its outputs are published, none lost); the
    row then leaves with a cache of all its tokens but the newest and finishes in the
    single-stream engine with exactly its solo output."""
    spec, engine = plain_engines(tiny_model_dir)
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:2]]
    requests = [greedy_request("stay", prompts[0], 40), greedy_request("go", prompts[1], 45)]
    left = {}

    def leave(step, seqs):
        if step != 10:
            return []
        assert engine.in_flight is not None
        outputs = engine.settle().outputs
        assert engine.in_flight is None and {o.request_id for o in outputs} == {"stay", "go"}
        left["state"], result = engine.hand_over("go")
        assert not result.outputs, "settled already: nothing more to commit"
        return outputs

    seqs, published, _ = drive(engine, requests, leave)
    state = left["state"]
    assert state.cached == len(state.seq.all_tokens) - 1
    engine.registry.transfer(spec.name)
    spec.take_over(state)
    while spec.active is not None:
        for output in spec.step().outputs:
            published["go"].extend(output.token_ids)
    engine.registry.transfer(engine.name)
    assert seqs["go"].generated == reference.greedy_tokens(prompts[1], 45) == published["go"]
    assert seqs["stay"].generated == reference.greedy_tokens(prompts[0], 40) == published["stay"]


def test_a_row_joining_mid_pipeline_settles_the_batch_first(tiny_model_dir, reference):
    """A migrated sequence joins a pipelined batch: the step in flight is committed
    first (its outputs come with the next step) and every output stays exact."""
    spec, engine = plain_engines(tiny_model_dir)
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:2]]
    tokenizer = reference.tokenizer
    joiner = make_sequence(greedy_request("join", prompts[1], 30), tokenizer)
    engine.registry.transfer(spec.name)
    spec.admit(joiner)
    early = []
    while len(joiner.generated) < 6:
        early += [t for o in spec.step().outputs for t in o.token_ids]
    state, result = spec.hand_over("join")
    early += [t for o in result.outputs for t in o.token_ids]
    engine.registry.transfer(engine.name)

    def join(step, seqs):
        if step == 8:
            assert engine.in_flight is not None
            engine.take_over(state)
            assert engine.in_flight is None, "the step in flight was committed first"

    seqs, published, pipelined = drive(engine, [greedy_request("run", prompts[0], 40)], join)
    assert seqs["run"].generated == reference.greedy_tokens(prompts[0], 40) == published["run"]
    assert joiner.generated == reference.greedy_tokens(prompts[1], 30)
    assert early + published["join"] == joiner.generated
    assert pipelined > 10


def test_logprobs_from_pipelined_steps_equal_unpipelined_ones(tiny_model_dir, reference):
    _, engine = plain_engines(tiny_model_dir)
    prompt = reference.tokenizer.encode(PROMPTS[3])
    requests = [greedy_request(f"r{i}", prompt, 20, logprobs=3) for i in range(2)]
    tokenizer = reference.tokenizer
    seqs = {r.request_id: make_sequence(r, tokenizer) for r in requests}
    for seq in seqs.values():
        engine.admit(seq)
    got, pipelined = [], 0
    while engine.batch_size:
        got += [o.logprobs for o in engine.step().outputs if o.request_id == "r0" and o.logprobs]
        pipelined += engine.in_flight is not None
    flat = [lp for chunk in got for lp in chunk]
    assert pipelined > 5 and len(flat) == 20
    cache = make_prompt_cache(reference.model)
    logits = reference.model(mx.array(prompt + seqs["r0"].generated[:-1])[None], cache=cache)
    logprobs = logits[0, len(prompt) - 1 :] - mx.logsumexp(
        logits[0, len(prompt) - 1 :], axis=-1, keepdims=True
    )
    for position, entry in enumerate(flat):
        assert entry.token == seqs["r0"].generated[position]
        assert abs(entry.logprob - logprobs[position, entry.token].item()) < 1e-4
        assert len(entry.top) == 3


def test_seeded_rows_in_a_pipeline_draw_their_solo_plain_tokens(tiny_model_dir, reference):
    _, engine = plain_engines(tiny_model_dir)
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:3]]

    def seeded(rid, prompt):
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
        return GenerationRequest(rid, tuple(prompt), 30, params, ignore_eos=True)

    alone, _, _ = drive(engine, [seeded("a", prompts[0])])
    others = [greedy_request(f"o{i}", p, 25) for i, p in enumerate(prompts[1:])]
    crowd = [seeded("a", prompts[0]), *others]
    together, _, pipelined = drive(engine, crowd)
    assert together["a"].generated == alone["a"].generated
    assert pipelined > 10


@pytest.mark.slow
def test_sampled_pipelined_rows_match_plain_sampling_distribution(tiny_model_dir, reference):
    """Unseeded rows sampled by queued steps: their first two tokens are distributed
    as single-stream plain sampling's (two-sample chi-square)."""
    spec, engine = plain_engines(tiny_model_dir)
    prompt = reference.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0.8)
    trials = 1000

    def request(i):
        return GenerationRequest(f"s{i}", tuple(prompt), 3, params, ignore_eos=True)

    batched = []
    for start in range(0, trials, 8):
        seqs, _, _ = drive(engine, [request(i) for i in range(start, start + 8)])
        batched += [tuple(seq.generated[1:3]) for seq in seqs.values()]
    engine.registry.transfer(spec.name)
    plain = []
    for i in range(trials):
        seq = make_sequence(request(i), reference.tokenizer)
        spec.admit(seq)
        while spec.active is not None:
            spec.step()
        plain.append(tuple(seq.generated[1:3]))
    engine.registry.transfer(engine.name)
    assert_same_token_distribution(batched, plain)


def test_a_batch_alternates_pipelined_plain_steps_and_lookup_verifies_exactly(
    tiny_model_dir, reference
):
    """With prompt lookup on, a batch pipelines while no row's lookup pays and verifies
    drafts when one does (planned from the newest committed tokens, one step late):
    output exact throughout."""
    _, engine = plain_engines(tiny_model_dir, num_draft_tokens=4, enable_pld=True)
    tokenizer = reference.tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    requests = [greedy_request(f"r{i}", p, 80) for i, p in enumerate(prompts)]
    seqs, published, pipelined = drive(engine, requests)
    for i, request in enumerate(requests):
        expected = reference.greedy_tokens(prompts[i], 80)
        assert seqs[request.request_id].generated == expected == published[request.request_id]
    assert pipelined > 0
    assert sum(seq.spec.draft_tokens for seq in seqs.values()) > 0


def test_a_plain_probe_among_drafting_steps_is_one_step_not_a_pipeline(tiny_model_dir, reference):
    """Plain steps that the cost model asks for as probes (to measure plain batching
    beside drafting) are one step each: a probe never starts a run of plain steps
    queued ahead (which cost a good draft several steps per probe). Whether the chooser
    also picks plain steps on its own depends on this machine's timings, so the test
    watches the steps at which a pipeline starts."""
    registry = ModelRegistry.load(str(tiny_model_dir), str(tiny_model_dir))
    spec = SpeculativeEngine(registry, SpecConfig(enable_pld=False), cost=COST)
    costs = BatchCosts(COST, learn=True, plain_every=8)
    engine = BatchedSpeculativeEngine(registry, spec.speculation, prefill_step_size=64, costs=costs)
    registry.transfer(engine.name)
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:2]]
    requests = [greedy_request(f"r{i}", p, 60) for i, p in enumerate(prompts)]
    plain_steps = 0
    pipelines_started_on_a_probe = []
    start_pipeline = engine._start_pipeline

    def spy_start_pipeline():
        pipelines_started_on_a_probe.append(costs.plain_probe_due(len(engine.rows)))
        return start_pipeline()

    engine._start_pipeline = spy_start_pipeline

    def watch(result):
        nonlocal plain_steps
        plain_steps += bool(result.step_sizes) and all(d == 0 for _, d in result.step_sizes)

    seqs, _, _ = drive(engine, requests, on_result=watch)
    for i, p in enumerate(prompts):
        assert seqs[f"r{i}"].generated == reference.greedy_tokens(p, 60)
    assert plain_steps >= 3, "plain steps were measured"
    assert not any(pipelines_started_on_a_probe)


def test_a_drafting_step_is_timed_from_the_previous_step_s_return(tiny_model_dir, reference):
    """A pipelined plain step's cost is the time between two commits, which includes
    what the caller does between steps (publishing outputs: overlapped with the next
    forward). A drafting step waits for that work, so it is judged the same way:
    from the previous step's return, not from its own call -- otherwise drafting that
    loses as served (at 8 rows, a few percent) looks cheaper than plain steps."""
    registry = ModelRegistry.load(str(tiny_model_dir), str(tiny_model_dir))
    spec = SpeculativeEngine(registry, SpecConfig(enable_pld=False), cost=COST)
    costs = BatchCosts(COST, learn=True)
    engine = BatchedSpeculativeEngine(registry, spec.speculation, prefill_step_size=64, costs=costs)
    registry.transfer(engine.name)
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:2]]
    # long enough for several drafting steps after the first forwards are measured
    # (a plan made before that is in the prior's units and is not an outcome)
    requests = [greedy_request(f"r{i}", p, 120) for i, p in enumerate(prompts)]
    host_work = 0.05

    def publish(step, seqs):
        time.sleep(host_work)

    seqs, _, _ = drive(engine, requests, publish)
    for i, p in enumerate(prompts):
        assert seqs[f"r{i}"].generated == reference.greedy_tokens(p, 120)
    drafting = costs.outcomes[2, MODEL]
    assert drafting.steps >= 3
    _, seconds, _, _ = drafting.averages
    assert seconds >= host_work  # the tiny model's own step takes a few milliseconds
