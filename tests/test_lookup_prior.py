"""Prompt lookup acceptance by match length, position by position, over a server-wide
prior: a weak match is judged weak all the way along, a new request starts from what
earlier ones saw, and its own text can overrule them."""

from __future__ import annotations

from engines.drafters import PLD
from engines.gates import MethodGate
from engines.measured_costs import CostModel
from engines.position_rates import LookupPrior, PositionRates
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from tests.conftest import make_client
from tests.test_batched_speculation import make_engines, run_batch

# verify costs relative to a plain step as measured on a 2-core CPU (wide-salty)
CPU_COSTS = CostModel((1.0, 1.21, 1.48, 1.79, 1.98, 2.2, 2.4, 2.6, 2.8), draft_step=0.08)
REPEATED = "one two three four five six seven. " * 8


def test_positions_after_the_first_rejection_learn_nothing():
    rates = PositionRates(weight=0.25)
    rates.record(drafted=4, accepted=1)  # position 1 accepted, 2 rejected, 3-4 untried
    rates.record(drafted=4, accepted=4)
    assert rates.reached == [2, 2, 1, 1]
    assert rates.rates == [1.0, 0.5, 1.0, 1.0]


def test_a_weak_match_is_judged_weak_all_the_way_along():
    """Half the drafts of either kind lose their first token. After it, a one-token
    match's copy breaks at once and a three-token match's runs to the end. Rates
    pooled after the first position would call both the same; per match length the
    gate drafts one token (at most) after a weak match and eight after a strong one."""
    gate = MethodGate(PLD, alpha=0.5)
    for verify in range(16):
        gate.record(8, 1 if verify % 2 else 0, 8, CPU_COSTS, match=1)
        gate.record(8, 8 if verify % 2 else 0, 8, CPU_COSTS, match=3)
    weak, strong = gate.acceptance(1), gate.acceptance(3)
    assert weak[1] < 0.3 and min(strong[1:]) > 0.8
    assert gate.draft_length(8, CPU_COSTS, match=1) <= 1
    assert gate.draft_length(8, CPU_COSTS, match=3) == 8


def _teach(prior: LookupPrior, verifies: int = 40) -> None:
    """Earlier requests: one-token matches almost never copy, three-token ones do."""
    earlier = MethodGate(PLD, alpha=0.5, prior=prior)
    for verify in range(verifies):
        earlier.record(2, 1 if verify % 10 == 0 else 0, 8, CPU_COSTS, match=1)
        earlier.record(8, 8, 8, CPU_COSTS, match=3)


def test_a_new_request_starts_from_what_earlier_requests_saw():
    prior = LookupPrior()
    _teach(prior)
    fresh = MethodGate(PLD, alpha=0.5, prior=prior)  # no verify of its own yet
    assert fresh.acceptance(1)[0] < 0.25
    assert min(fresh.acceptance(3)) > 0.85
    assert fresh.draft_length(8, CPU_COSTS, match=1) == 0
    assert fresh.open  # a weak match skipped, the gate still open for strong ones
    assert fresh.draft_length(8, CPU_COSTS, match=3) == 8
    # the same request on a server that had seen nothing would guess 0.5 for both
    alone = MethodGate(PLD, alpha=0.5)
    assert alone.draft_length(8, CPU_COSTS, match=1) > 0
    assert alone.draft_length(8, CPU_COSTS, match=3) < 8


def test_a_request_that_copies_overrules_the_server_prior():
    """A code edit copies its prompt even from one-token matches; its own verifies
    outweigh what other requests' stories taught the server."""
    prior = LookupPrior()
    _teach(prior, verifies=200)
    edit = MethodGate(PLD, alpha=0.5, prior=prior)
    for _ in range(8):
        edit.record(6, 6, 8, CPU_COSTS, match=1)
    assert edit.acceptance(1)[0] > 0.7
    assert edit.draft_length(8, CPU_COSTS, match=1) >= 4
    # and another request is still judged by the server's rates, which the edit moved
    # only a little (it is one request among many)
    other = MethodGate(PLD, alpha=0.5, prior=prior)
    assert other.acceptance(1)[0] < 0.5 * edit.acceptance(1)[0]


def test_the_single_stream_and_batched_engines_teach_one_prior(tiny_model_dir, perturbed_draft_dir):
    """Every request's gates share the server's prior, whichever engine serves them, so
    what the batch learns a lone request starts from (and the reverse)."""
    spec, batched = make_engines(tiny_model_dir, perturbed_draft_dir)
    tokenizer = spec.registry.tokenizer
    prompt = tuple(tokenizer.encode(REPEATED))
    requests = [
        GenerationRequest(
            f"r{i}",
            prompt,
            24,
            SamplingParams(temperature=0.0),
            ignore_eos=True,
            speculation=SpeculationOverrides(enable_pld=True, enable_draft=False),
        )
        for i in range(3)
    ]
    seqs, _, drafted = run_batch(batched, requests)
    assert drafted > 0
    stats = [seq.spec.by_method.get(PLD) for seq in seqs.values()]
    verifies = sum(s.drafts for s in stats if s is not None)
    assert verifies > 0
    reached_first = [rates.reached[0] for rates in spec.lookup_prior.by_match.values()]
    assert sum(reached_first) == verifies  # every lookup verify, once
    gates = spec.initial_gates(next(iter(seqs.values())))
    assert gates[PLD].prior is spec.lookup_prior


async def test_the_prior_is_in_stats(spec_scheduler):
    async with make_client(spec_scheduler) as client:
        response = await client.post(
            "/v1/completions",
            json={
                "prompt": REPEATED,
                "max_tokens": 24,
                "temperature": 0,
                "enable_draft": False,
            },
        )
        assert response.status_code == 200
        stats = (await client.get("/v1/stats")).json()
    lookup = stats["speculation"]["costs"]["lookup_acceptance"]
    assert lookup, "a repetitive prompt's lookup verifies reach the server's prior"
    for by_position in lookup.values():
        rates, reached = by_position["acceptance_per_position"], by_position["reached"]
        assert len(rates) == len(reached) and reached[0] >= max(reached)
        assert all(0.0 <= rate <= 1.0 for rate in rates)


def test_a_match_length_the_estimates_skip_is_probed_again():
    """Earlier requests taught the server that three-token matches miss and two-token
    ones copy. This request loops, so every lookup is a three-token match that would
    copy: the gate stays open (two-token matches would pay) and, without probes of
    the skipped match length, would never draft one nor learn that here they copy."""
    prior = LookupPrior()
    earlier = MethodGate(PLD, alpha=0.5, prior=prior)
    for _ in range(40):
        earlier.record(4, 0, 8, CPU_COSTS, match=3)
        earlier.record(4, 4, 8, CPU_COSTS, match=2)
    gate = MethodGate(PLD, alpha=0.5, prior=prior)
    lengths = []
    for _ in range(40):
        k = gate.draft_length(8, CPU_COSTS, match=3)
        if k:
            gate.record(k, k, 8, CPU_COSTS, match=3)
        lengths.append(k)
    assert gate.open
    assert lengths[:7] == [0] * 7  # the server's estimate is trusted at first
    assert lengths[7] == gate.probe_k  # then a probe
    assert lengths[-1] >= 4  # and the request's own verifies win


def test_a_batch_plans_a_due_probe_at_the_prior():
    prior = LookupPrior()
    _teach(prior)
    gate = MethodGate(PLD, alpha=0.5, prior=prior)
    planned = [gate.planned_acceptance(1, 8, CPU_COSTS) for _ in range(8)]
    assert all(acceptance[0] < 0.25 for acceptance in planned[:7])
    assert planned[7] == (0.5,)
    # the batch did not draft it (other rows, other costs): offered again as soon
    planned = [gate.planned_acceptance(1, 8, CPU_COSTS) for _ in range(8)]
    assert [p == (0.5,) for p in planned] == [False] * 7 + [True]
    gate.record(2, 0, 8, CPU_COSTS, match=1)  # drafted, and missed: the next waits longer
    planned = [gate.planned_acceptance(1, 8, CPU_COSTS) for _ in range(16)]
    assert [p == (0.5,) for p in planned] == [False] * 15 + [True]


def test_a_few_misses_do_not_stop_a_server_from_drafting_a_match_length():
    """The server's rates only learn from drafts that were made: a few early misses
    read as a plain average would say three-token matches never copy, nothing would
    draft them again, and nothing would correct it. Read at the upper end of what the
    observations allow, a few misses leave them worth trying; many do not."""
    few, many = LookupPrior(), LookupPrior()
    for prior, misses in ((few, 3), (many, 200)):
        earlier = MethodGate(PLD, alpha=0.5, prior=prior)
        for _ in range(misses):
            earlier.record(2, 0, 8, CPU_COSTS, match=3)
    assert MethodGate(PLD, alpha=0.5, prior=few).draft_length(8, CPU_COSTS, match=3) > 0
    assert MethodGate(PLD, alpha=0.5, prior=many).draft_length(8, CPU_COSTS, match=3) == 0
