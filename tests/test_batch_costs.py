"""The batched draft-length policy: K by expected tokens per measured second, costs
learned from the engine's own forwards (monotone in tokens, extended along the measured
curve), predictions calibrated by what steps really committed per second, and
exploration so a pessimistic prior cannot hide the best K."""

from __future__ import annotations

import pytest

from engines.batched.costs import BatchCosts, RowOption, choose_draft_length
from engines.gating.measured_costs import CostModel

FLAT = CostModel.assumed(9, per_token=0.02, draft_step=0.05)
STEEP = CostModel.assumed(9, per_token=1.0, draft_step=0.05)


def choice(costs: BatchCosts, options: list[list[RowOption]], k_max: int) -> tuple[int, bool]:
    plan = choose_draft_length(costs, options, k_max)
    return plan.k, plan.with_model


def rows(count: int, alpha: float, cap: int = 4, model: bool = True) -> list[list[RowOption]]:
    return [[RowOption(alpha, cap, model)] for _ in range(count)]


def test_high_acceptance_on_cheap_verifies_drafts_the_longest():
    costs = BatchCosts(FLAT, learn=False)
    assert choice(costs, rows(4, 0.95), 4) == (4, True)


def test_when_verifying_costs_as_much_as_decoding_the_batch_decodes_plainly():
    costs = BatchCosts(STEEP, learn=False)
    assert choice(costs, rows(8, 0.5), 4) == (0, False)


def test_rows_without_options_decode_and_pld_needs_no_draft_model():
    costs = BatchCosts(FLAT, learn=False)
    options = [[RowOption(0.9, 3, False)], []]
    assert choice(costs, options, 4) == (3, False)


def test_measured_costs_replace_the_prior_and_change_the_choice():
    costs = BatchCosts(FLAT)
    for _ in range(3):
        costs.observe_target(4, 0.040)  # plain step of 4 rows
        costs.observe_target(20, 0.400)  # K = 4: ten times the cost
    assert costs.target_cost(20) == 0.400
    assert choice(costs, rows(4, 0.6), 4)[0] < 4


def test_measured_costs_are_made_monotone_in_tokens():
    costs = BatchCosts(FLAT)
    for seconds, tokens in ((0.08, 8), (0.12, 12), (0.09, 16), (0.115, 20)):
        for _ in range(3):
            costs.observe_target(tokens, seconds)
    fitted = [costs.target_cost(n) for n in (8, 12, 16, 20)]
    assert fitted == sorted(fitted)
    assert abs(fitted[1] - 0.105) < 1e-9 and fitted[0] == 0.08


def test_an_unmeasured_neighbouring_k_is_tried_every_few_decisions():
    costs = BatchCosts(STEEP, explore_every=4)
    for _ in range(3):
        costs.observe_target(4, 0.040)  # only the plain step is measured
    choices = [choice(costs, rows(4, 0.9), 4) for _ in range(8)]
    assert choices.count((0, False)) == 6
    assert all(k == 1 for k, _ in choices if k != 0), "exploration tries K = 1"


def measured_forwards(costs: BatchCosts, batch: int) -> None:
    """Forward costs measured (in seconds) for a plain step and K = 4 at `batch` rows."""
    for _ in range(costs.min_samples):
        costs.observe_target(batch, 0.040)
        costs.observe_target(batch * 5, 0.050)


def serve_plain(costs: BatchCosts, batch: int, steps: int) -> None:
    plain = choose_draft_length(costs, [[] for _ in range(batch)], 0)
    assert plain.k == 0
    for _ in range(steps):
        costs.observe_outcome(batch, plain, batch, plain.cost)


def test_drafting_that_measurably_commits_less_per_second_than_plain_stops():
    costs = BatchCosts(FLAT, explore_every=1000)
    options = rows(4, 0.9, model=False)
    measured_forwards(costs, 4)
    assert choice(costs, options, 4) == (0, False), "plain steps are measured first"
    serve_plain(costs, 4, costs.min_samples)
    drafting = choose_draft_length(costs, options, 4)
    assert drafting.k == 4 and drafting.rate > 1.5 * 4 / 0.040
    for _ in range(costs.min_drafting_samples):  # as served: a plain step's tokens, slower
        costs.observe_outcome(4, drafting, 4, drafting.cost)
    assert costs.calibration(4, "lookup") < 0.6
    assert choice(costs, options, 4) == (0, False)

    measured_forwards(costs, 2)  # another batch size keeps its own measurements
    serve_plain(costs, 2, costs.min_samples)
    assert choice(costs, rows(2, 0.9, model=False), 4)[0] > 0


def test_drafting_that_really_commits_less_per_second_than_plain_sits_out_but_for_probes():
    """Calibration scales the average prediction, so a step predicted far above the
    calibrating ones still looks worth drafting after calibration. What drafting steps
    really committed per second, against plain steps at the same batch size, decides:
    slower drafting waits, one probe step in `probe_every` runs it, and a probe that
    pays brings it back."""
    costs = BatchCosts(FLAT, explore_every=1000, probe_every=5)
    measured_forwards(costs, 4)
    serve_plain(costs, 4, costs.min_samples)  # 4 tokens per 0.040 s: 100 tokens/s
    modest = costs.plan(4, 4, False, 8.0)  # predicted 160 tokens/s
    for _ in range(costs.min_drafting_samples):
        costs.observe_outcome(4, modest, 5, 0.055)  # served: 91 tokens/s
    assert costs.calibration(4, "lookup") == pytest.approx((5 / 0.055) / 160)
    assert costs.realized_rate(4, "lookup") < costs.realized_rate(4, "plain")

    confident = rows(4, 0.95, model=False)
    picks = []
    for _ in range(11):
        plan = choose_draft_length(costs, confident, 4)
        picks.append(plan.k)
        if plan.k:  # the probe: calibration alone would have drafted every step
            assert plan.rate * costs.calibration(4, "lookup") > 1.5 * 100
            costs.observe_outcome(4, plan, 5, 0.055)
        else:
            costs.observe_outcome(4, plan, 4, 0.040)
    assert picks == [0] * 5 + [4] + [0] * 5

    probe = choose_draft_length(costs, confident, 4)
    assert probe.k == 4
    costs.observe_outcome(4, probe, 20, 0.050)  # the rows now copy: 400 tokens/s
    assert costs.realized_rate(4, "lookup") > costs.realized_rate(4, "plain")
    assert choice(costs, confident, 4) == (4, False)


def test_a_few_unlucky_drafting_steps_make_no_verdict_and_the_first_weighs_no_more():
    """Drafting steps commit anywhere from 1 to 1 + K tokens per row: three bad ones
    neither calibrate nor veto drafting at that batch size, and once judged, the
    average is a plain mean at first (the first step does not outweigh the rest)."""
    costs = BatchCosts(FLAT, explore_every=1000)
    options = rows(4, 0.9, model=False)
    measured_forwards(costs, 4)
    serve_plain(costs, 4, costs.min_samples)
    drafting = choose_draft_length(costs, options, 4)
    for _ in range(3):  # unlucky: a plain step's tokens in a verify's time
        costs.observe_outcome(4, drafting, 4, 0.050)
    assert costs.realized_rate(4, "lookup") is None
    assert costs.calibration(4, "lookup") == 1.0
    assert choice(costs, options, 4) == (4, False), "still drafting"
    for _ in range(costs.min_drafting_samples - 3):  # then as predicted: 10 tokens
        costs.observe_outcome(4, drafting, 10, 0.050)
    mean = (3 * 4 + (costs.min_drafting_samples - 3) * 10) / costs.min_drafting_samples
    assert costs.realized_rate(4, "lookup") == pytest.approx(mean / 0.050, rel=0.01)
    assert choice(costs, options, 4) == (4, False)


def test_drafting_that_pays_as_predicted_keeps_running_with_a_plain_step_now_and_then():
    costs = BatchCosts(FLAT, explore_every=1000, plain_every=10)
    options = rows(4, 0.9, model=False)
    measured_forwards(costs, 4)
    serve_plain(costs, 4, costs.min_samples)
    choices = []
    for _ in range(22):
        plan = choose_draft_length(costs, options, 4)
        choices.append(plan.k)
        costs.observe_outcome(4, plan, round(plan.tokens), plan.cost)
    assert choices.count(0) == 2 and choices[10] == 0 and choices[21] == 0
    assert costs.calibration(4, "lookup") == pytest.approx(1.0, rel=0.1)


def test_plain_steps_at_several_batch_sizes_predict_the_cost_of_wider_verifies():
    """Plain steps of 2, 4 and 8 rows trace how a forward's cost grows with its tokens,
    and a verify of 8 rows x 2 tokens is predicted from that curve -- not from the
    single-stream prior's nearly flat verify costs. Compute-bound (every token costs
    about the same): drafting at 40% or even 95% acceptance does not pay at 8 rows.
    Memory-bound (extra tokens nearly free): a looping batch drafts."""
    compute_bound = BatchCosts(FLAT, explore_every=1000)
    memory_bound = BatchCosts(FLAT, explore_every=1000)
    for costs, curve in (
        (compute_bound, ((2, 0.030), (4, 0.050), (8, 0.090))),
        (memory_bound, ((2, 0.030), (4, 0.034), (8, 0.040))),
    ):
        for rows_, seconds in curve:
            for _ in range(costs.min_samples):
                costs.observe_target(rows_, seconds)
        serve_plain(costs, 8, costs.min_samples)
    assert compute_bound.target_cost(6) == pytest.approx(0.070)
    assert compute_bound.target_cost(16) == pytest.approx(0.170)
    assert compute_bound.target_cost(1) < 0.030
    assert choice(compute_bound, rows(8, 0.4, model=False), 4) == (0, False)
    assert choice(compute_bound, rows(8, 0.95, model=False), 4) == (0, False)
    assert memory_bound.target_cost(16) == pytest.approx(0.052)
    assert choice(memory_bound, rows(8, 0.95, model=False), 4)[0] > 0


def test_a_plan_predicted_before_any_forward_was_measured_never_calibrates():
    """The step whose forward is the third measurement of its size was planned in the
    prior's units (ratios near 1), not seconds: comparing its outcome with seconds would
    skew that batch size's calibration tenfold for dozens of steps."""
    costs = BatchCosts(FLAT)
    early = choose_draft_length(costs, [[] for _ in range(4)], 0)
    assert not early.in_seconds
    measured_forwards(costs, 4)  # the forward of that very step completes the measurement
    costs.observe_outcome(4, early, 4, 0.040)
    assert costs.outcomes == {}
    serve_plain(costs, 4, costs.min_samples)
    assert costs.calibration(4, "plain") == pytest.approx(1.0)
