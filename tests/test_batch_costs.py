"""The batched draft-length policy: K by expected tokens per measured second, costs
learned from the engine's own forwards (monotone in tokens), and exploration so a
pessimistic prior cannot hide the best K."""

from __future__ import annotations

from engines.batch_costs import BatchCosts, RowOption, choose_draft_length
from engines.gates import CostModel

FLAT = CostModel.assumed(9, per_token=0.02, draft_step=0.05)
STEEP = CostModel.assumed(9, per_token=1.0, draft_step=0.05)


def rows(count: int, alpha: float, cap: int = 4, model: bool = True) -> list[list[RowOption]]:
    return [[RowOption(alpha, cap, model)] for _ in range(count)]


def test_high_acceptance_on_cheap_verifies_drafts_the_longest():
    costs = BatchCosts(FLAT, learn=False)
    assert choose_draft_length(costs, rows(4, 0.95), 4) == (4, True)


def test_when_verifying_costs_as_much_as_decoding_the_batch_decodes_plainly():
    costs = BatchCosts(STEEP, learn=False)
    assert choose_draft_length(costs, rows(8, 0.5), 4) == (0, False)


def test_rows_without_options_decode_and_pld_needs_no_draft_model():
    costs = BatchCosts(FLAT, learn=False)
    options = [[RowOption(0.9, 3, False)], []]
    assert choose_draft_length(costs, options, 4) == (3, False)


def test_measured_costs_replace_the_prior_and_change_the_choice():
    costs = BatchCosts(FLAT)
    for _ in range(3):
        costs.observe_target(4, 0.040)  # plain step of 4 rows
        costs.observe_target(20, 0.400)  # K = 4: ten times the cost
    assert costs.target_cost(20) == 0.400
    choice = choose_draft_length(costs, rows(4, 0.6), 4)
    assert choice[0] < 4


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
    choices = [choose_draft_length(costs, rows(4, 0.9), 4) for _ in range(8)]
    assert choices.count((0, False)) == 6
    assert all(k == 1 for k, _ in choices if k != 0), "exploration tries K = 1"
