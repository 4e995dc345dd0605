"""The single-stream cost model: measured robustly at start-up on a noisy machine,
corrected by the engine's own steps, and shown in /v1/stats and /metrics.

The start-up measurement is driven through a real tiny model whose forwards are made to
cost a known time (a sleep proportional to the tokens fed), so the true cost ratios are
known and the machine's own speed, drifting or disturbed, can be simulated."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from engines.drafting.draft import DRAFT, PLD
from engines.gating.gates import MethodGate, best_draft_length, expected_tokens
from engines.gating.measured_costs import (
    PLAIN,
    CostModel,
    Measured,
    OnlineCosts,
    RealizedRates,
    monotone_fit,
)
from engines.model.registry import LoadedModel, ModelRegistry
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from engines.sequence import make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from tests.conftest import make_client


class TimedModel:
    """A real model whose forward over n tokens takes (fixed + per_token * n) seconds
    times `slowdown(call number)`: a machine of known, controllable speed."""

    def __init__(self, model, fixed: float, per_token: float, slowdown=lambda call: 1.0) -> None:
        self.model, self.fixed, self.per_token, self.slowdown = model, fixed, per_token, slowdown
        self.calls = 0
        self.verify_slowdown = 1.0  # extra factor on forwards of more than one token

    def next_seconds(self, tokens) -> float:
        """The time this forward is to take (counts the call)."""
        self.calls += 1
        n = tokens.shape[1]
        factor = self.slowdown(self.calls) * (self.verify_slowdown if n > 1 else 1.0)
        return (self.fixed + self.per_token * n) * factor

    def __call__(self, tokens, cache=None):
        time.sleep(self.next_seconds(tokens))
        return self.model(tokens, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


class ExactTimedModel(TimedModel):
    """A TimedModel whose forward takes exactly its time, the model's own compute
    included (evaluated, then topped up with a sleep): on a loaded CI machine the tiny
    model's compute grows with the tokens fed and would otherwise add to the sleeps of
    a verify but hide under a pipelined plain step's, so the true ratios drift."""

    def __call__(self, tokens, cache=None):
        seconds, start = self.next_seconds(tokens), time.perf_counter()
        logits = self.model(tokens, cache=cache)
        mx.eval(logits)
        time.sleep(max(0.0, seconds - (time.perf_counter() - start)))
        return logits


def true_verify(n: int, fixed: float, per_token: float) -> float:
    return (fixed + per_token * n) / (fixed + per_token)


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model_dir):
    return load(str(tiny_model_dir), return_config=True)  # model, tokenizer, config


@pytest.fixture(scope="module")
def tiny(tiny_loaded):
    return tiny_loaded[0]


@pytest.mark.parametrize(
    "slowdown",
    [
        pytest.param(lambda call: 1.0 + call / 200, id="machine slowing down by half"),
        pytest.param(lambda call: 4.0 if 30 <= call < 45 else 1.0, id="burst of interference"),
    ],
)
def test_startup_costs_are_right_on_a_drifting_or_disturbed_machine(tiny, slowdown):
    fixed, per_token = 0.020, 0.005  # sleeps well above the tiny model's own compute
    model = ExactTimedModel(tiny, fixed, per_token, slowdown)
    draft = ExactTimedModel(tiny, 0.008, 0.0, lambda call: 1.0)
    cost = CostModel.measure(model, draft, max_tokens=9)
    for n in range(1, 10):
        expected = true_verify(n, fixed, per_token)
        assert cost.verify_cost(n) == pytest.approx(expected, rel=0.12), (n, cost.verify)
    assert cost.draft_step == pytest.approx(0.008 / (fixed + per_token), rel=0.2)
    assert list(cost.verify) == sorted(cost.verify)


def test_monotone_fit_averages_a_noisy_size_with_its_neighbours():
    assert monotone_fit([1.0, 1.5, 1.2, 1.6]) == pytest.approx([1.0, 1.35, 1.35, 1.6])
    # one noisy size does not lift every larger size to its level (a running max would)
    fitted = monotone_fit([1.0, 2.2, 1.1, 1.2, 1.3, 1.4])
    assert fitted[-1] < 1.6 and fitted == sorted(fitted)
    assert monotone_fit([1.0, 1.1, 1.2]) == [1.0, 1.1, 1.2]


def test_a_pessimistic_startup_measurement_is_corrected_by_real_steps():
    """Start-up said verifying 3 tokens costs 2.5 plain steps; the engine's own steps say
    1.1. After a few steps the gates use what the steps say."""
    costs = OnlineCosts(CostModel((1.0, 2.0, 2.5, 2.6), draft_step=0.5))
    for _ in range(8):
        costs.observe_plain(0.010)
        costs.observe_verify(3, 0.011)
        costs.observe_draft(2, 0.004)
    model = costs.model()
    assert model.verify_cost(3) == pytest.approx(1.1, rel=0.02)
    assert model.verify_cost(2) <= model.verify_cost(3)  # still non-decreasing
    # sizes never verified: the start-up shape, scaled by how far off it was at size 3
    assert 1.1 <= model.verify_cost(4) < 1.2
    assert model.draft_step == pytest.approx(0.2, rel=0.02)
    snapshot = costs.snapshot()
    assert snapshot["measured_at_startup"]["verify"][2] == 2.5
    assert snapshot["verify"][2] == pytest.approx(1.1, rel=0.02)
    assert snapshot["samples"]["v3"] == 8


async def test_the_costs_in_use_are_in_stats_and_metrics(spec_scheduler):
    async with make_client(spec_scheduler) as client:
        stats = (await client.get("/v1/stats")).json()
        metrics = (await client.get("/metrics")).text
    costs = stats["speculation"]["costs"]
    # what the test schedulers are given (9 sizes), continued at its slope to the 17 a
    # prompt lookup draft of 16 tokens verifies
    expected = CostModel.assumed(17)
    assert costs["verify"] == pytest.approx(list(expected.verify), abs=1e-4)
    assert costs["draft_step"] == pytest.approx(expected.draft_step)
    assert costs["learning"] is False
    calibration = costs["draft_confidence"]  # the draft's acceptance by its confidence
    assert len(calibration) == 10
    assert all(0 <= b["acceptance"] <= 1 and b["seen"] >= 0 for b in calibration.values())
    label = f'model_name="{stats["model"]}"'
    for n, cost in enumerate(expected.verify, start=1):
        line = f'tandem_spec_verify_cost_ratio{{{label},tokens="{n}"}} {round(cost, 4)}\n'
        assert line in metrics
    assert f"tandem_spec_draft_step_cost_ratio{{{label}}} {expected.draft_step}\n" in metrics


def test_verify_costs_past_the_measured_sizes_continue_the_measured_tail():
    measured = CostModel((1.0, 1.2, 1.3, 1.5, 1.6, 1.9), draft_step=0.3, plain_seconds=0.01)
    extended = measured.extended(9)
    assert extended.verify[:6] == measured.verify
    slope = (1.9 - 1.2) / 4  # over the last four sizes
    assert extended.verify[6:] == pytest.approx([1.9 + slope, 1.9 + 2 * slope, 1.9 + 3 * slope])
    assert (extended.draft_step, extended.plain_seconds) == (0.3, 0.01)
    assert measured.extended(4) is measured
    falling = CostModel((1.0, 1.6, 1.5, 1.4, 1.3, 1.2)).extended(8)
    assert falling.verify[6:] == (1.2, 1.2), "more tokens never cost less than fewer"


# ---- gates that trust what was measured over what was predicted ----------------------

PESSIMISTIC = CostModel((1.0, 4.0, 5.0, 6.0, 7.0), draft_step=0.2)
OPTIMISTIC = CostModel((1.0, 1.05, 1.1, 1.15, 1.2), draft_step=0.05)


def test_a_prediction_that_measurement_contradicts_is_not_trusted():
    gate = MethodGate(DRAFT, alpha=0.8, last_k=3)
    assert best_draft_length(0.8, 4, PESSIMISTIC, DRAFT) == 0
    best_anyway = best_draft_length(0.8, 4, PESSIMISTIC, DRAFT, floor=0.0)
    assert best_anyway > 0  # measured faster: draft the best predicted k
    assert gate.open_length(4, PESSIMISTIC, Measured(1.4, {})) == best_anyway
    assert best_draft_length(0.8, 4, OPTIMISTIC, DRAFT) > 0
    assert gate.open_length(4, OPTIMISTIC, Measured(0.8, {})) == 0  # measured slower: do not
    assert gate.record(3, 0, 4, OPTIMISTIC, Measured(0.8, {})) is True  # and the gate closes


def test_a_draft_accepted_half_the_time_drafts_until_measured_slower():
    draft_gate, pld_gate = MethodGate(DRAFT, alpha=0.6), MethodGate(PLD, alpha=0.6)
    best_anyway = best_draft_length(0.6, 4, PESSIMISTIC, DRAFT, floor=0.0)
    assert draft_gate.open_length(4, PESSIMISTIC, None) == best_anyway > 0
    assert pld_gate.open_length(4, PESSIMISTIC, None) == 0
    assert MethodGate(DRAFT, alpha=0.3).open_length(4, PESSIMISTIC, None) == 0


def test_a_trusted_draft_pair_keeps_drafting_through_a_run_of_rejections():
    """A request's first drafts rejected four times in a row push its own acceptance
    far below half; with the pair trusted (accepted half the time over the server's
    life) the gate stays open and drafts, until drafting is measured slower."""
    cost = CostModel((1.0, 1.25, 1.5, 1.73, 1.78), draft_step=0.09)
    untrusted, trusted = MethodGate(DRAFT, alpha=0.6), MethodGate(DRAFT, alpha=0.6)
    for _ in range(4):
        untrusted.record(4, 0, 4, cost)
        trusted.record(4, 0, 4, cost, trusted=True)
    assert trusted.acceptance()[0] < 0.3
    assert not untrusted.open and untrusted.draft_length(4, cost) == 0
    assert trusted.open and trusted.draft_length(4, cost, trusted=True) > 0
    assert trusted.draft_length(4, cost, Measured(0.9, {}), trusted=True) == 0  # slower
    assert not trusted.open


def test_realized_rates_compare_drafting_with_plain_and_ask_for_probes():
    rates = RealizedRates.starting_from(plain_seconds=0.02)  # 50 tokens/s at start-up
    assert rates.speedup(DRAFT) is None
    for _ in range(rates.min_draft_steps):
        rates.observe(DRAFT, 0.03, 3)  # 100 tokens/s drafting
    assert rates.speedup(DRAFT) is None  # a few drafting steps do not make a verdict
    rates.observe(DRAFT, 0.03, 3)
    assert rates.speedup(DRAFT) == pytest.approx(2.0)
    assert not rates.plain_probe_due()
    for _ in range(rates.stale_after):
        rates.observe(DRAFT, 0.03, 3)
    # 2x plain: only a large change of the machine's speed could reverse that, so the
    # comparison is renewed less often than a close one
    assert not rates.plain_probe_due()
    assert rates.probe_interval() == rates.stale_after * rates.wide_margin_spacing
    for _ in range(rates.probe_interval() - rates.stale_after):
        rates.observe(DRAFT, 0.03, 3)
    assert rates.plain_probe_due()  # plain was last seen long ago: measure it again
    rates.observe(PLAIN, 0.04, 1)  # the machine got slower for plain steps too
    assert not rates.plain_probe_due()
    assert rates.speedup(DRAFT) > 2.0  # so drafting gains more than start-up said


def test_a_close_comparison_is_probed_at_the_usual_interval():
    rates = RealizedRates.starting_from(plain_seconds=0.02)  # 50 tokens/s
    for _ in range(rates.min_draft_steps + 1):
        rates.observe(DRAFT, 0.018, 1)  # 56 tokens/s: 1.1x, a verdict a small drift flips
    assert rates.probe_interval() == rates.stale_after
    for _ in range(rates.stale_after - rates.since_plain):
        rates.observe(DRAFT, 0.018, 1)
    assert rates.plain_probe_due()


def test_an_open_gate_that_finds_nothing_worth_drafting_lets_plain_steps_pipeline(
    tiny_model_dir,
):
    """With costs that make no draft length pay, PLD's gate (open: the prompt repeats
    itself) must close, so plain steps pipeline instead of running one by one."""
    registry = ModelRegistry.load(str(tiny_model_dir))
    engine = SpeculativeEngine(registry, SpecConfig(), cost=PESSIMISTIC)
    registry.transfer(engine.name)
    prompt = registry.tokenizer.encode("def add(a, b):\n    return a + b\n" * 4)
    request = GenerationRequest(
        "r", tuple(prompt), 24, SamplingParams(temperature=0.0), ignore_eos=True
    )
    engine.admit(make_sequence(request, registry.tokenizer))
    pipelined = 0
    while engine.active is not None:
        engine.step()
        pipelined += engine.active is not None and engine.active.in_flight is not None
    assert pipelined >= 16


@pytest.mark.slow
def test_a_draft_the_startup_measurement_misjudged_still_drafts_and_stays_exact(tiny_loaded):
    """Start-up ran on a disturbed machine: every multi-token forward took six times its
    real cost, so the measured costs say drafting never pays. Served, verifies are cheap
    and the draft (the target's own weights) is always right: the engine must find that
    out by drafting, and its output is plain decoding's."""
    tiny, tokenizer, config = tiny_loaded
    target = TimedModel(tiny, 0.0195, 0.0045)
    draft = TimedModel(tiny, 0.002, 0.0)
    target.verify_slowdown = 6.0
    registry = ModelRegistry(
        LoadedModel("target", target, tokenizer, config),
        LoadedModel("draft", draft, tokenizer, config),
    )
    engine = SpeculativeEngine(registry, SpecConfig(enable_pld=False))
    registry.transfer(engine.name)
    assert best_draft_length(0.9, 4, engine.costs.model(), DRAFT) == 0  # start-up misjudged it
    target.verify_slowdown = 1.0

    prompt = tokenizer.encode("Once upon a time there was a little robot")
    request = greedy_request(prompt, 48, SpeculationOverrides(enable_draft=True))
    seq = make_sequence(request, tokenizer)
    engine.admit(seq)
    while engine.active is not None:
        engine.step()
    plain = [t for t, _ in generate_step(mx.array(prompt), tiny, max_tokens=48)]
    assert seq.generated == plain
    assert seq.spec.accepted_tokens >= 24, seq.spec


def test_each_draft_length_is_judged_by_what_it_gave_when_served():
    """The cost model says one drafted token is best for a draft accepted 55% of the
    time; served, acceptance came in runs and four tokens gave more. Once each length
    was measured a few times, the gate drafts four."""
    cost = CostModel((1.0, 1.21, 1.48, 1.79, 1.79), draft_step=0.08)
    gate = MethodGate(DRAFT, alpha=0.55)
    assert gate.open_length(4, cost, None) == 1  # the prediction alone
    rates = RealizedRates.starting_from(plain_seconds=0.040)
    for _ in range(rates.min_draft_steps // 2 + 2):
        # k=1: 1.55 tokens per step, as predicted, but at 1.42 plain steps, not 1.29
        rates.observe_draft(DRAFT, 1, 0.040 * 1.42, 1.55, (1.55, 1.29))
        # k=4: 2.6 tokens per step where 2.11 were predicted, at the predicted cost
        rates.observe_draft(DRAFT, 4, 0.040 * 2.11, 2.6, (2.11, 2.11))
    measured = rates.measured(DRAFT)
    assert measured.calibration(1) == pytest.approx(1.29 / 1.42, rel=0.01)
    assert measured.calibration(4) == pytest.approx(2.6 / 2.11, rel=0.01)
    assert measured.calibration(2) == 1.0  # never measured: the prediction stands
    assert gate.open_length(4, cost, measured) == 4


# ---- acceptance learned per draft position ---------------------------------------------

CPU_COSTS = CostModel((1.0, 1.21, 1.48, 1.79, 1.98, 2.2, 2.4, 2.6, 2.8), draft_step=0.08)


def test_expected_tokens_multiplies_the_per_position_rates():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)  # one rate
    assert expected_tokens((0.5, 1.0, 0.5), 3) == pytest.approx(1 + 0.5 + 0.5 + 0.25)
    assert expected_tokens((0.5, 0.9), 4) == pytest.approx(1 + 0.5 + 0.45 + 0.405 + 0.3645)


def test_acceptance_that_comes_in_runs_drafts_long():
    """A draft whose first token is right 60% of the time and, when it is, is right to
    the end of a four-token draft (it copies, or the text is easy). One rate for every
    position (0.6 overall for the first token) says one drafted token pays best; per
    position the gate sees runs and drafts four."""
    gate = MethodGate(DRAFT, alpha=0.6)
    for verify in range(20):
        gate.record(4, 4 if verify % 5 < 3 else 0, 4, CPU_COSTS)
    acceptance = gate.acceptance()
    assert acceptance[0] == pytest.approx(0.6, abs=0.15)
    assert min(acceptance[1:]) > 0.85
    assert best_draft_length(acceptance[0], 4, CPU_COSTS, DRAFT) == 1  # the one-rate model
    assert gate.open_length(4, CPU_COSTS, None) == 4


def test_a_position_never_reached_inherits_the_last_one_observed():
    """Drafts so far were two tokens, always right: longer drafts are predicted to be
    right as well (not the prior's 0.5), so the gate tries them."""
    gate = MethodGate(PLD, alpha=0.5)
    for _ in range(6):
        gate.record(2, 2, 8, CPU_COSTS)
    assert len(gate.acceptance()) == 2
    assert gate.expected(8) > 0.75 * 9  # the prior alone: under 2
    assert gate.open_length(8, CPU_COSTS, None) == 8


def test_few_observations_of_a_position_lean_on_the_one_before():
    """One lucky verify that reached position 3 and was accepted there does not make
    position 3 certain while position 1 is a coin flip."""
    gate = MethodGate(DRAFT, alpha=0.5)
    for accepted in (0, 1, 0, 3, 0, 1):
        gate.record(3, accepted, 3, CPU_COSTS)
    first, _, third = gate.acceptance()
    assert first == pytest.approx(0.5, abs=0.1)
    assert third < 0.85


def test_prompt_lookup_skips_weak_matches_and_keeps_drafting_strong_ones():
    """Three-token matches copy (all accepted); one-token matches almost never do. The
    gate learns that per match length: it stops drafting from one-token matches but
    stays open, and drafts long from three-token ones."""
    gate = MethodGate(PLD, alpha=0.5)
    for _ in range(8):
        gate.record(4, 4, 8, CPU_COSTS, match=3)
        gate.record(4, 0, 8, CPU_COSTS, match=1)
    assert gate.acceptance(1)[0] < 0.3 < 0.8 < gate.acceptance(3)[0]
    assert gate.draft_length(8, CPU_COSTS, match=1) == 0
    assert gate.open  # a weak match that does not pay is skipped, the gate stays open
    assert gate.draft_length(8, CPU_COSTS, match=3) >= 6


def test_prompt_lookup_that_commits_less_per_second_than_plain_stops_for_the_request():
    """The output copied its prompt for a while, so the gate learned long runs and keeps
    drafting seven tokens; now each such verify commits about 1.3 tokens in 1.75 plain
    steps. Once this request's own verifies show that (fewer tokens per second than
    plain steps), the prediction gives way and the gate stops drafting."""
    plain_rate = 25.0  # tokens/s of plain steps (0.04 s each)
    gate = MethodGate(PLD, alpha=0.5)
    for _ in range(6):
        gate.record(7, 7, 8, CPU_COSTS, match=3)  # the copying stretch
    assert gate.open_length(8, CPU_COSTS, None, match=3) >= 6
    assert gate.measured_against(plain_rate) is None  # no outcome seen yet
    for step in range(gate.min_outcomes):
        gate.observe_outcome(0.07, 2 if step % 3 == 0 else 1)
    measured = gate.measured_against(plain_rate)
    assert measured.speedup == pytest.approx((4 / 3) / 0.07 / plain_rate, rel=0.15)
    assert gate.open_length(8, CPU_COSTS, measured, match=3) == 0
    # the same verifies committing 3.5 tokens each would have paid: it keeps drafting
    paying = MethodGate(PLD, alpha=0.5)
    for _ in range(6):
        paying.record(7, 7, 8, CPU_COSTS, match=3)
    for _ in range(paying.min_outcomes):
        paying.observe_outcome(0.07, 3.5)
    assert paying.open_length(8, CPU_COSTS, paying.measured_against(plain_rate), match=3) > 0


def test_prompt_lookup_outcomes_ride_out_a_short_bad_run():
    """A code edit copies in short runs (each 7-token verify commits 4 on average, 1.5x
    plain), then hits three edit points in a row (nothing accepted). Prompt lookup's
    yield swings like that all through an edit, so three bad verifies must not make the
    request's measured speed-up say "slower than plain": that closed the gate for type
    hints, 1.58x -> 1.90x plain in a replay on Qwen2.5-Coder-1.5B. A lasting change
    still shows: ten bad verifies in a row do stop it."""
    plain_rate = 25.0
    gate = MethodGate(PLD, alpha=0.5)
    verify_seconds = 0.04 * CPU_COSTS.verify_cost(8)
    for _ in range(12):
        gate.record(7, 3, 8, CPU_COSTS, match=3)
        gate.observe_outcome(verify_seconds, 4)
    for _ in range(3):
        gate.record(7, 0, 8, CPU_COSTS, match=3)
        gate.observe_outcome(verify_seconds, 1)
    assert gate.measured_against(plain_rate).speedup > 1.0
    assert gate.open_length(8, CPU_COSTS, gate.measured_against(plain_rate), match=3) > 0
    for _ in range(7):
        gate.record(7, 0, 8, CPU_COSTS, match=3)
        gate.observe_outcome(verify_seconds, 1)
    assert gate.measured_against(plain_rate).speedup < 0.95


def test_the_engine_feeds_each_request_s_prompt_lookup_outcomes_to_its_gate(tiny_model_dir):
    """Served with measured costs (as a server runs), every prompt lookup verify is
    timed into the request's own gate, so its drafting is judged by what it gives."""
    registry = ModelRegistry.load(str(tiny_model_dir))
    engine = SpeculativeEngine(registry, SpecConfig())
    registry.transfer(engine.name)
    prompt = registry.tokenizer.encode("one two three four five six seven. " * 8)
    request = greedy_request(prompt, 48, SpeculationOverrides(enable_pld=True))
    seq = make_sequence(request, registry.tokenizer)
    engine.admit(seq)
    gate = engine.active.drafting.gates[PLD]
    while engine.active is not None:
        engine.step()
    lookups = seq.spec.by_method["pld"].drafts if "pld" in seq.spec.by_method else 0
    assert lookups > 0 and gate.outcomes == lookups


def greedy_request(prompt: list[int], max_tokens: int, speculation: SpeculationOverrides):
    return GenerationRequest(
        "r",
        tuple(prompt),
        max_tokens,
        SamplingParams(temperature=0.0),
        ignore_eos=True,
        speculation=speculation,
    )


class SlowCatchUp(TimedModel):
    """A draft whose forwards over more than two tokens (catching up on a prompt or on
    plain steps) take `catch_up` seconds more."""

    def __init__(self, model, catch_up: float) -> None:
        super().__init__(model, 0.001, 0.0)
        self.catch_up = catch_up

    def __call__(self, tokens, cache=None):
        if tokens.shape[1] > 2:
            time.sleep(self.catch_up)
        return super().__call__(tokens, cache=cache)


def test_every_drafting_step_counts_less_the_catch_up_it_needed(tiny_loaded):
    """Drafting's measured rate leaves out the time spent catching the draft model up
    (a prompt, a run of plain steps) but counts the step: before, steps after a catch
    up of more than 32 tokens were left out entirely, so a closed gate's probes after
    long plain runs never counted and a verdict of "slower" could not be revised."""
    tiny, tokenizer, config = tiny_loaded
    registry = ModelRegistry(
        LoadedModel("target", TimedModel(tiny, 0.01, 0.001), tokenizer, config),
        LoadedModel("draft", SlowCatchUp(tiny, catch_up=0.3), tokenizer, config),
    )
    engine = SpeculativeEngine(registry, SpecConfig(enable_pld=False))
    registry.transfer(engine.name)
    prompt = tokenizer.encode("Once upon a time there was a little robot who " * 4)
    assert len(prompt) > 40
    seq = make_sequence(greedy_request(prompt, 32, SpeculationOverrides()), tokenizer)
    engine.admit(seq)
    while engine.active is not None:
        engine.step()
    drafts = seq.spec.by_method[DRAFT].drafts
    assert drafts > 2 and seq.spec.accepted_tokens == seq.spec.draft_tokens  # its own draft
    assert engine.realized.steps[DRAFT] == drafts, "the first, after the prompt, counts"
    # the 0.3 s catch-up is not in it: drafting measured faster than plain steps
    assert engine.realized.seconds[DRAFT] < 0.1
    assert engine.realized.speedup(DRAFT) is None or engine.realized.speedup(DRAFT) > 1


def test_a_draft_pair_is_trusted_once_its_first_token_is_accepted_in_half_its_drafts(
    tiny_model_dir,
):
    registry = ModelRegistry.load(str(tiny_model_dir), str(tiny_model_dir))
    engine = SpeculativeEngine(registry, SpecConfig(), cost=PESSIMISTIC)
    assert not engine.policy.trusted_draft()
    for i in range(32):  # 16 of 32 drafts had their first token accepted
        engine.totals.record(DRAFT, 4, 2 if i % 2 else 0)
    assert engine.policy.trusted_draft()
    engine.totals.record(DRAFT, 4, 0)
    assert not engine.policy.trusted_draft()
