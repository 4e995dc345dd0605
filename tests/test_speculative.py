"""The speculative engine: greedy output token-identical to plain decoding with every
drafter, sampled output exact in distribution, gates that switch drafting off and
back on, and state that can be exported and resumed without changing the output."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors

from engines.drafting.draft_model import DraftModelDrafter, DraftState
from engines.gating.measured_costs import CostModel
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from engines.sample.sampling import RandomStream
from engines.sequence import FinishReason, make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from tests.distributions import assert_same_token_distribution

COST = CostModel.assumed(9)
CODE_PROMPT = "def add(a, b):\n    return a + b\n" * 4
STORY_PROMPT = "Once upon a time there was a little robot who loved to read books"


def make_engine(target_dir, draft_dir=None, **config) -> SpeculativeEngine:
    registry = ModelRegistry.load(str(target_dir), str(draft_dir) if draft_dir else None)
    engine = SpeculativeEngine(registry, SpecConfig(**config), cost=COST)
    registry.transfer(engine.name)
    return engine


GREEDY = SamplingParams(temperature=0.0)


def run(engine, prompt_ids, max_tokens, *, sampling=GREEDY, rng=None, **kw):
    request = GenerationRequest("r", tuple(prompt_ids), max_tokens, sampling, **kw)
    seq = make_sequence(request, engine.registry.tokenizer)
    if rng is not None:
        seq.rng = rng
    engine.admit(seq)
    outputs = []
    while engine.active is not None:
        outputs.extend(engine.step().outputs)
    return seq, outputs


@pytest.fixture(scope="module")
def self_draft_engine(tiny_model_dir):
    """Draft = the target itself: acceptance ~100%, long accepted runs."""
    return make_engine(tiny_model_dir, tiny_model_dir)


@pytest.fixture(scope="module")
def perturbed_engine(tiny_model_dir, perturbed_draft_dir):
    return make_engine(tiny_model_dir, perturbed_draft_dir)


@pytest.fixture(scope="module")
def random_draft_engine(tiny_model_dir, tiny_draft_dir):
    return make_engine(tiny_model_dir, tiny_draft_dir)


@pytest.fixture(scope="module")
def pld_engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def repetitive_bias(tokenizer, n_tokens: int = 3) -> tuple:
    """Logit bias that makes the tiny model loop over a few tokens, so PLD has
    something to find (a random model does not copy by itself)."""
    ids = sorted(set(tokenizer.encode(CODE_PROMPT)))[:n_tokens]
    return tuple((t, 8.0) for t in ids)


@pytest.mark.parametrize("prompt", [CODE_PROMPT, STORY_PROMPT])
@pytest.mark.parametrize("engine_name", ["self_draft", "perturbed", "random_draft"])
def test_greedy_draft_model_equals_plain_for_200_tokens(request, reference, engine_name, prompt):
    engine = request.getfixturevalue(f"{engine_name}_engine")
    prompt_ids = reference.tokenizer.encode(prompt)
    seq, _ = run(engine, prompt_ids, 240, ignore_eos=True)
    assert seq.generated == reference.greedy_tokens(prompt_ids, 240)
    assert seq.spec.by_method["draft"].drafts > 0
    if engine_name == "self_draft":
        draft = seq.spec.by_method["draft"]
        assert draft.accepted_tokens >= 0.9 * draft.draft_tokens


def test_perturbed_draft_has_partial_acceptance(perturbed_engine, reference):
    prompt_ids = reference.tokenizer.encode(STORY_PROMPT)
    seq, _ = run(perturbed_engine, prompt_ids, 200, ignore_eos=True)
    stats = seq.spec.by_method["draft"]
    assert 0 < stats.accepted_tokens < stats.draft_tokens


@pytest.mark.parametrize("n_tokens", [1, 2, 3])
def test_greedy_pld_equals_plain_on_repetitive_output(pld_engine, reference, n_tokens):
    prompt_ids = reference.tokenizer.encode(CODE_PROMPT)
    bias = repetitive_bias(reference.tokenizer, n_tokens)
    sampling = SamplingParams(temperature=0.0, logit_bias=bias)
    seq, _ = run(pld_engine, prompt_ids, 240, sampling=sampling, ignore_eos=True)
    processors = make_logits_processors(logit_bias=dict(bias))
    assert seq.generated == reference.greedy_tokens(prompt_ids, 240, logits_processors=processors)
    assert seq.spec.by_method["pld"].accepted_tokens > 20


def test_greedy_pld_and_draft_together_equal_plain(tiny_model_dir, perturbed_draft_dir, reference):
    engine = make_engine(tiny_model_dir, perturbed_draft_dir)
    prompt_ids = reference.tokenizer.encode(CODE_PROMPT)
    bias = repetitive_bias(reference.tokenizer, 3)
    sampling = SamplingParams(temperature=0.0, logit_bias=bias, repetition_penalty=1.1)
    seq, _ = run(engine, prompt_ids, 240, sampling=sampling, ignore_eos=True)
    processors = make_logits_processors(logit_bias=dict(bias), repetition_penalty=1.1)
    assert seq.generated == reference.greedy_tokens(prompt_ids, 240, logits_processors=processors)
    assert {"pld", "draft"} <= set(seq.spec.by_method)


@pytest.mark.parametrize("max_tokens", [201, 202, 203])
def test_max_tokens_inside_an_accepted_run_is_exact(self_draft_engine, reference, max_tokens):
    prompt_ids = reference.tokenizer.encode(STORY_PROMPT)
    seq, outputs = run(self_draft_engine, prompt_ids, max_tokens, ignore_eos=True)
    assert seq.generated == reference.greedy_tokens(prompt_ids, max_tokens)
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(o.token_ids) for o in outputs) == max_tokens
    assert max(len(o.token_ids) for o in outputs) > 1, "runs of several tokens expected"


def test_stop_string_inside_an_accepted_run_emits_nothing_past_it(self_draft_engine, reference):
    prompt_ids = reference.tokenizer.encode(STORY_PROMPT)
    detok = reference.tokenizer.detokenizer
    for token in reference.greedy_tokens(prompt_ids, 120):
        detok.add_token(token)
    detok.finalize()
    full = detok.text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    seq, outputs = run(self_draft_engine, prompt_ids, 120, ignore_eos=True, stop=(stop,))
    text = "".join(o.text for o in outputs)
    assert text == full[: full.index(stop)]
    assert seq.finish_reason == FinishReason.STOP and seq.matched_stop == stop
    emitted = [t for o in outputs for t in o.token_ids]
    assert emitted == seq.generated, "no token past the stop is emitted"
    assert len(emitted) < 120


def test_eos_inside_an_accepted_run_stops_there(self_draft_engine, reference):
    prompt_ids = reference.tokenizer.encode("Hello, world!")
    expected = reference.greedy_until_eos(prompt_ids, 400)
    assert expected[-1] in reference.tokenizer.eos_token_ids
    seq, _ = run(self_draft_engine, prompt_ids, 400)
    assert seq.generated == expected and seq.finish_reason == FinishReason.STOP


def test_per_request_overrides_disable_methods(tiny_model_dir, perturbed_draft_dir, reference):
    engine = make_engine(tiny_model_dir, perturbed_draft_dir)
    prompt_ids = reference.tokenizer.encode(CODE_PROMPT)
    off = SpeculationOverrides(enable_pld=False, enable_draft=False)
    seq, _ = run(engine, prompt_ids, 60, ignore_eos=True, speculation=off)
    assert seq.spec.drafts == 0
    zero_k = SpeculationOverrides(num_draft_tokens=0)
    seq, _ = run(engine, prompt_ids, 60, ignore_eos=True, speculation=zero_k)
    assert seq.spec.drafts == 0
    only_draft = SpeculationOverrides(enable_pld=False, num_draft_tokens=2)
    seq, _ = run(engine, prompt_ids, 60, ignore_eos=True, speculation=only_draft)
    assert set(seq.spec.by_method) == {"draft"}
    assert len(seq.spec.accepted_per_position) <= 2
    assert seq.generated == reference.greedy_tokens(prompt_ids, 60)


# ---- gates -------------------------------------------------------------------------


def test_novel_prompt_closes_pld_at_prompt_time(pld_engine, reference):
    prompt_ids = reference.tokenizer.encode("Write about the weather.")
    seq, _ = run(pld_engine, prompt_ids, 20, ignore_eos=True)
    assert seq.spec.gate_trips.get("prompt") == 1
    repetitive = reference.tokenizer.encode(CODE_PROMPT)
    seq, _ = run(pld_engine, repetitive, 20, ignore_eos=True)
    assert "prompt" not in seq.spec.gate_trips


def test_run_of_rejections_turns_drafting_off(random_draft_engine, reference):
    prompt_ids = reference.tokenizer.encode(STORY_PROMPT)
    seq, _ = run(
        random_draft_engine,
        prompt_ids,
        300,
        ignore_eos=True,
        speculation=SpeculationOverrides(enable_pld=False),
    )
    stats = seq.spec.by_method["draft"]
    assert stats.accepted_tokens < 0.3 * stats.draft_tokens, "fixture should mostly reject"
    assert seq.spec.gate_trips.get("runtime", 0) >= 1
    assert stats.drafts < 30, "after the trip only sparse re-probes should draft"


def test_repetition_turns_pld_back_on_after_prompt_gate(pld_engine, reference):
    prompt_ids = reference.tokenizer.encode("Write about the weather.")
    bias = repetitive_bias(reference.tokenizer, 1)
    seq, _ = run(
        pld_engine,
        prompt_ids,
        200,
        sampling=SamplingParams(temperature=0.0, logit_bias=bias),
        ignore_eos=True,
    )
    assert seq.spec.gate_trips.get("prompt") == 1
    pld = seq.spec.by_method["pld"]
    assert pld.accepted_tokens > 100, "PLD must re-engage once the output repeats"


def test_plain_steps_after_gating_off_pipeline_like_plain_decoding(pld_engine, reference):
    prompt_ids = reference.tokenizer.encode("Write about the weather.")
    seq, outputs = run(pld_engine, prompt_ids, 100, ignore_eos=True)
    assert seq.spec.drafts <= 4
    assert all(len(o.token_ids) == 1 for o in outputs)


# ---- export / resume ---------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("split_after", [1, 37])
def test_export_and_resume_gives_the_uninterrupted_output(
    tiny_model_dir, perturbed_draft_dir, reference, temperature, split_after
):
    engine = make_engine(tiny_model_dir, perturbed_draft_dir)
    prompt_ids = reference.tokenizer.encode(CODE_PROMPT)
    sampling = SamplingParams(temperature=temperature, seed=99, top_p=0.95)
    expected, _ = run(engine, prompt_ids, 120, sampling=sampling, ignore_eos=True)

    request = GenerationRequest("r", tuple(prompt_ids), 120, sampling, ignore_eos=True)
    seq = make_sequence(request, engine.registry.tokenizer)
    engine.admit(seq)
    while len(seq.generated) < split_after:
        engine.step()
    state, _ = engine.hand_over("r")
    assert engine.active is None
    assert state.cached == len(seq.all_tokens) - 1, "cache holds all committed but the last"
    other = make_engine(tiny_model_dir, perturbed_draft_dir)
    other.take_over(state)
    while other.active is not None:
        other.step()
    assert seq.generated == expected.generated


# ---- sampled distribution end to end -----------------------------------------------


def first_tokens(
    engine, prompt_ids, trials: int, spec: bool, max_tokens: int = 2
) -> list[tuple[int, ...]]:
    sampling_overrides = (
        SpeculationOverrides() if spec else SpeculationOverrides(num_draft_tokens=0)
    )
    pairs = []
    for seed in range(trials):
        # An unseeded request's RNG (sequential draws: the Leviathan rejection rule),
        # started from a fixed key so the test is repeatable.
        rng = RandomStream(mx.random.key(seed + (0 if spec else trials)))
        params = SamplingParams(temperature=0.8, top_k=6)
        seq, _ = run(
            engine,
            prompt_ids,
            max_tokens,
            sampling=params,
            rng=rng,
            ignore_eos=True,
            speculation=sampling_overrides,
        )
        pairs.append(tuple(seq.generated))
    return pairs


@pytest.mark.slow
def test_sampled_speculative_first_tokens_match_plain_distribution(perturbed_engine, reference):
    prompt_ids = reference.tokenizer.encode(STORY_PROMPT)
    trials = 1500
    spec = first_tokens(perturbed_engine, prompt_ids, trials, spec=True)
    plain = first_tokens(perturbed_engine, prompt_ids, trials, spec=False)
    assert_same_token_distribution(spec, plain)
    assert perturbed_engine.totals.by_method["draft"].accepted_tokens > 0


@pytest.mark.parametrize("engine_name", ["perturbed", "pld"])
def test_seeded_sampling_gives_plain_seeded_tokens_whatever_the_drafting(
    request, reference, engine_name
):
    """A seeded request's randomness is keyed by (seed, position), and drafts are
    verified against the plain seeded sample at each position: drafting on or off,
    and any draft length, give the same tokens."""
    engine = request.getfixturevalue(f"{engine_name}_engine")
    prompt_ids = reference.tokenizer.encode(CODE_PROMPT)
    params = SamplingParams(temperature=0.8, top_k=20, seed=1234)
    outputs = []
    for overrides in (
        SpeculationOverrides(num_draft_tokens=0),
        SpeculationOverrides(),
        SpeculationOverrides(num_draft_tokens=2),
    ):
        seq, _ = run(
            engine, prompt_ids, 60, sampling=params, ignore_eos=True, speculation=overrides
        )
        outputs.append(seq.generated)
        if overrides.num_draft_tokens != 0 and engine_name == "perturbed":
            assert seq.spec.accepted_tokens > 0
    assert outputs[0] == outputs[1] == outputs[2]


def test_each_request_drafts_from_its_own_ngram_index(pld_engine, reference):
    """Prompt lookup proposes only from the request's own tokens: after a repetitive
    request A, a longer request B sharing no n-gram with A finds its own repeats and
    nothing of A's (a shared, append-only index skipped B's first tokens and kept A's)."""
    a = reference.tokenizer.encode(CODE_PROMPT)
    run(pld_engine, a, 20, ignore_eos=True)
    fresh = [t for t in range(300, 3000) if t not in set(a)][: len(a) + 30]
    b = [*fresh, *fresh[:3]]  # B repeats its own first three tokens at the end
    seq = make_sequence(GenerationRequest("b", tuple(b), 4, GREEDY), reference.tokenizer)
    pld_engine.admit(seq)
    try:
        drafter = pld_engine.active.drafting.pld
        draft = drafter.propose(pld_engine.active.tokens, 4)
        assert draft is not None and draft.tokens == fresh[3:7]
        assert drafter.tokens == b, "the index holds B's tokens only"
    finally:
        pld_engine.cancel("b")


def test_a_commit_failing_during_hand_over_fails_only_that_request(tiny_model_dir, reference):
    """Export commits a pipelined token in flight; if that commit raises (a broken
    constraint, a fault), the request ends with an error output instead of the
    exception escaping into the mode switch (which failed the whole server)."""
    engine = make_engine(tiny_model_dir, enable_pld=False)
    prompt = reference.tokenizer.encode(STORY_PROMPT)
    request = GenerationRequest("h", tuple(prompt), 50, GREEDY, ignore_eos=True)
    seq = make_sequence(request, reference.tokenizer)
    engine.admit(seq)
    while len(seq.generated) < 5:
        engine.step()
    assert engine.active.in_flight is not None, "plain steps are pipelined"

    class Broken:
        failure = "constrained decoding failed: broken matcher"

        def __call__(self, tokens, logits):
            return logits

    seq.processors.append(Broken())
    state, result = engine.hand_over(seq.request_id)
    outputs = result.outputs
    assert engine.active is None
    assert state is None and seq.finish_reason == FinishReason.ERROR
    assert outputs[-1].finish_reason == FinishReason.ERROR and "broken" in outputs[-1].error


def test_prompt_lookup_drafts_past_the_draft_models_k_when_copies_run_long(pld_engine, reference):
    """Prompt lookup's drafts cost nothing to make, so a long copy gets drafts longer
    than --num-draft-tokens (4 here), up to the cap, and stays exact; a request's own
    num_draft_tokens still caps them."""
    prompt_ids = reference.tokenizer.encode(CODE_PROMPT)
    bias = repetitive_bias(reference.tokenizer, 1)
    sampling = SamplingParams(temperature=0.0, logit_bias=bias)
    processors = make_logits_processors(logit_bias=dict(bias))
    plain = reference.greedy_tokens(prompt_ids, 120, logits_processors=processors)
    seq, _ = run(pld_engine, prompt_ids, 120, sampling=sampling, ignore_eos=True)
    assert seq.generated == plain
    assert len(seq.spec.accepted_per_position) > 4
    assert seq.spec.accepted_per_position[4] > 0  # a fifth drafted token was accepted
    capped = SpeculationOverrides(num_draft_tokens=2)
    seq, _ = run(
        pld_engine, prompt_ids, 120, sampling=sampling, ignore_eos=True, speculation=capped
    )
    assert seq.generated == plain
    assert len(seq.spec.accepted_per_position) == 2


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_lazy_draft_chain_proposes_what_token_by_token_drafting_does(
    tiny_model_dir, perturbed_draft_dir, reference, temperature
):
    """The draft model's k steps run as one lazy chain read once, with or without
    processors (here a no-op one, which sees the history as a lazy array): same
    tokens, same q, same cache."""
    registry = ModelRegistry.load(str(tiny_model_dir), str(perturbed_draft_dir))
    drafter = DraftModelDrafter(registry.draft.model, registry.draft.vocab_size)
    context = reference.tokenizer.encode(STORY_PROMPT)
    params = SamplingParams(temperature=temperature)

    def unchanged(tokens, logits):
        return logits

    chain_state, stepwise_state = DraftState(), DraftState()
    chain = drafter.propose(chain_state, context, 6, params, RandomStream.from_seed(7))
    stepwise = drafter.propose(
        stepwise_state, context, 6, params, RandomStream.from_seed(7), [unchanged]
    )
    assert chain.tokens == stepwise.tokens
    assert chain_state.fed == stepwise_state.fed == [*context, *chain.tokens[:-1]]
    if temperature:
        assert mx.allclose(chain.probs, stepwise.probs).item()
    else:
        assert chain.probs is None and stepwise.probs is None
