"""Draft-model proposals that stop where the draft is unsure: the calibration of its
confidence, the stopping rule, and -- through the real engine -- that stopping changes
how much is drafted, never what is emitted (greedy equality, sampled distribution)."""

from __future__ import annotations

import pytest

from engines.gating.draft_confidence import MEMORY, ConfidenceCalibration, DraftStop
from engines.gating.measured_costs import CostModel
from engines.request import SpeculationOverrides
from engines.spec_config import SpecConfig
from server.cli import build_parser
from tests.distributions import assert_same_token_distribution
from tests.test_speculative import STORY_PROMPT, first_tokens, make_engine, run

CHEAP_DRAFT = CostModel.assumed(9)  # verify 1 + 0.15 per token, a draft step 0.1


def calibrated(confidence: float, accepted: bool, proposals: int = 200):
    calibration = ConfidenceCalibration()
    for _ in range(proposals):
        calibration.observe([confidence] * 4, 4 if accepted else 0)
    return calibration


# ---- calibration -------------------------------------------------------------------


def test_before_any_verify_a_drafts_probability_is_its_acceptance():
    calibration = ConfidenceCalibration()
    assert calibration.acceptance(0.05) == pytest.approx(0.05)
    assert calibration.acceptance(0.95) == pytest.approx(0.95)


def test_a_pair_that_is_right_when_unsure_is_learned_and_shared_with_empty_bins():
    """A distilled draft is right even at p=0.3; bins never seen borrow the pair's rate."""
    calibration = calibrated(0.35, accepted=True)
    assert calibration.acceptance(0.35) > 0.95
    assert calibration.acceptance(0.05) > 0.9  # unobserved: pulled to the pooled rate
    rates = [calibration.acceptance((b + 0.5) / 10) for b in range(10)]
    assert rates == sorted(rates)  # never less likely right when surer


def test_only_the_drafts_a_verify_tried_are_counted():
    """Accepting 1 of 4 says the first was right and the second wrong; the last two were
    never compared with the target and teach nothing."""
    calibration = ConfidenceCalibration()
    calibration.observe([0.91, 0.72, 0.55, 0.15], accepted=1)
    assert calibration.hits[9] == 1 and calibration.seen[9] == 1
    assert calibration.hits[7] == 0 and calibration.seen[7] == 1
    assert calibration.seen[5] == calibration.seen[1] == 0


def test_old_observations_fade_when_the_content_changes():
    calibration = calibrated(0.95, accepted=True, proposals=1000)
    assert calibration.seen[9] == MEMORY
    for _ in range(int(MEMORY)):
        calibration.observe([0.95], accepted=0)
    assert calibration.acceptance(0.95) < 0.5


# ---- the stopping rule ------------------------------------------------------------


def test_a_draft_that_is_always_right_drafts_to_the_cap():
    stop = DraftStop(CHEAP_DRAFT, calibrated(0.95, accepted=True))
    assert all(stop.add(0.95) for _ in range(8))
    assert stop.best_length() == 8
    tokens, cost = stop.predicted(8)
    assert tokens > 8.5 and cost == pytest.approx(CHEAP_DRAFT.verify_cost(9) + 8 * 0.1)


def test_a_draft_that_is_never_right_stops_after_one_token():
    stop = DraftStop(CHEAP_DRAFT, calibrated(0.95, accepted=False))
    assert stop.add(0.95) is False
    assert stop.best_length() == 1


def test_drafting_stops_at_the_first_unsure_token_and_keeps_what_pays():
    """Sure, sure, then a guess: one more token after the guess does not pay, and
    verifying the guess still costs more than it is expected to bring."""
    calibration = ConfidenceCalibration()
    for _ in range(200):
        calibration.observe([0.95, 0.95, 0.05], accepted=2)  # sure ones right, guess wrong
    stop = DraftStop(CostModel((1.0, 1.3, 1.6, 1.9, 2.2), draft_step=0.1), calibration)
    assert stop.add(0.95) and stop.add(0.95)
    assert stop.add(0.05) is False
    assert stop.best_length() == 2


# ---- settings ---------------------------------------------------------------------


def test_num_draft_tokens_unset_keeps_defaults_and_a_number_caps_every_draft():
    parser = build_parser()
    unset = parser.parse_args(["serve", "m"]).num_draft_tokens
    assert unset is None
    default = SpecConfig.for_server(unset)
    assert default.num_draft_tokens == 8
    capped = SpecConfig.for_server(
        parser.parse_args(["serve", "m", "--num-draft-tokens", "3"]).num_draft_tokens
    )
    assert capped.num_draft_tokens == 3
    off = SpecConfig.for_server(0)
    assert off.num_draft_tokens == 0


# ---- through the engine -----------------------------------------------------------


def test_a_matched_draft_drafts_past_the_batched_k_and_output_equals_plain(
    tiny_model_dir, reference
):
    """The target as its own draft: every token is accepted though the random model is
    never sure of one (its probabilities are low), so the calibration learns that the
    pair is right when unsure and the proposals run to 8 tokens, twice the fixed 4."""
    engine = make_engine(tiny_model_dir, tiny_model_dir, num_draft_tokens=8)
    prompt_ids = reference.tokenizer.encode(STORY_PROMPT)
    seq, _ = run(engine, prompt_ids, 160, ignore_eos=True)
    assert seq.generated == reference.greedy_tokens(prompt_ids, 160)
    assert len(seq.spec.accepted_per_position) == 8
    assert seq.spec.accepted_per_position[7] > 5
    bins = engine.confidence.snapshot().values()
    assert sum(b["seen"] for b in bins) > 20
    assert all(b["acceptance"] > 0.9 for b in bins if b["seen"] > 5)


def test_a_partly_right_draft_varies_its_length_and_output_equals_plain(
    tiny_model_dir, perturbed_draft_dir, reference
):
    engine = make_engine(tiny_model_dir, perturbed_draft_dir)
    prompt_ids = reference.tokenizer.encode(STORY_PROMPT)
    lengths = []
    propose = engine.drafter.propose

    def recording(*args, **kwargs):
        draft = propose(*args, **kwargs)
        lengths.append(len(draft.tokens))
        return draft

    engine.drafter.propose = recording
    seq, _ = run(engine, prompt_ids, 200, ignore_eos=True)
    assert seq.generated == reference.greedy_tokens(prompt_ids, 200)
    assert len(set(lengths)) > 1, lengths  # the length follows the draft's confidence


def test_a_requests_num_draft_tokens_caps_a_confident_proposal(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir, tiny_model_dir, enable_pld=False)
    prompt_ids = reference.tokenizer.encode(STORY_PROMPT)
    overrides = SpeculationOverrides(num_draft_tokens=3)
    seq, _ = run(engine, prompt_ids, 80, ignore_eos=True, speculation=overrides)
    assert seq.generated == reference.greedy_tokens(prompt_ids, 80)
    assert len(seq.spec.accepted_per_position) == 3


@pytest.mark.slow
def test_sampled_output_with_confidence_stopping_keeps_plain_distribution(
    tiny_model_dir, perturbed_draft_dir, reference
):
    """Unseeded sampling (the Leviathan rule) over 6 tokens, so proposals stop at many
    different lengths: tokens at later positions keep plain sampling's distribution."""
    engine = make_engine(tiny_model_dir, perturbed_draft_dir, enable_pld=False)
    prompt_ids = reference.tokenizer.encode(STORY_PROMPT)
    samples = {
        spec: first_tokens(engine, prompt_ids, 700, spec, max_tokens=6) for spec in (True, False)
    }
    assert_same_token_distribution(samples[True], samples[False], positions=(2, 4, 5))
    draft = engine.totals.by_method["draft"]
    assert 0 < draft.accepted_tokens < draft.draft_tokens
    assert sum(engine.confidence.seen) > 0
