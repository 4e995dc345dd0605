"""A batch's rows: the ragged cache they share, rows leaving and joining with their
caches and drafting state, and each draft-model row's own limits (split from
test_batched_speculation.py, whose helpers they use)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from engines.cache.ragged_cache import RaggedKVCache, ragged_from_rows
from engines.request import SpeculationOverrides
from engines.sequence import make_sequence
from engines.state import SequenceState
from tests.test_batched_speculation import (
    CODE_PROMPT,
    PROMPTS,
    greedy_request,
    make_engines,
    round_trip_through_the_batch,
    run_batch,
)


@pytest.fixture(scope="module")
def perturbed(tiny_model_dir, perturbed_draft_dir):
    return make_engines(tiny_model_dir, perturbed_draft_dir)


@pytest.fixture(scope="module")
def self_draft(tiny_model_dir):
    return make_engines(tiny_model_dir, tiny_model_dir)


def test_ragged_cache_rows_roll_back_alone_and_match_single_sequence_decoding(reference):
    model = reference.model
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    drafts = [[20, 21, 22], [23, 24, 25], [26, 27, 28]]
    caches = []
    for prompt in prompts:
        cache = make_prompt_cache(model)
        model(mx.array(prompt[:-1])[None], cache=cache)
        caches.append(cache)
    ragged = ragged_from_rows(caches)
    verify = model(
        mx.array([[p[-1], *d] for p, d in zip(prompts, drafts, strict=True)]), cache=ragged
    )
    for i, (prompt, draft) in enumerate(zip(prompts, drafts, strict=True)):
        alone = model(mx.array([*prompt, *draft])[None])[0, len(prompt) - 1 :]
        assert mx.allclose(verify[i], alone, atol=1e-4).item()
    kept = [1, 3, 0]  # accepted drafts per row: each row rolls back by its own amount
    for layer in ragged:
        layer.set_lengths([len(p) + k for p, k in zip(prompts, kept, strict=True)])
    following = model(mx.array([[30], [31], [32]]), cache=ragged)
    for i, (prompt, draft, k) in enumerate(zip(prompts, drafts, kept, strict=True)):
        alone = model(mx.array([*prompt, *draft[:k], 30 + i])[None])[0, -1]
        assert mx.allclose(following[i, -1], alone, atol=1e-4).item()


def test_ragged_cache_refuses_to_roll_forward():
    cache = RaggedKVCache([3, 4])
    with pytest.raises(ValueError):
        cache.set_lengths([4, 4])


def test_ragged_rows_extract_to_the_exact_single_sequence_cache(reference):
    model = reference.model
    rows = []
    for prompt in ([1, 2, 3, 4, 5], [6, 7]):
        cache = make_prompt_cache(model)
        model(mx.array(prompt)[None], cache=cache)
        rows.append(cache)
    ragged = ragged_from_rows(rows)
    for i, cache in enumerate(rows):
        extracted = [layer.extract(i) for layer in ragged]
        for got, want in zip(extracted, cache, strict=True):
            assert isinstance(got, KVCache) and got.offset == want.offset
            assert mx.array_equal(got.keys[..., : got.offset, :], want.keys[..., : want.offset, :])


def test_migration_in_and_out_of_the_batch_keeps_draft_state_and_output(perturbed, reference):
    """A sequence moves single-stream -> batch -> single-stream with its target cache,
    its draft-model cache and its n-gram index; output equals uninterrupted decoding."""
    spec, engine = perturbed
    seq, back, _ = round_trip_through_the_batch(spec, engine, reference)
    assert back.drafting.draft is not None and back.drafting.pld is not None
    assert back.drafting.draft.fed == seq.all_tokens[: len(back.drafting.draft.fed)]
    assert seq.spec.by_method["draft"].draft_tokens > 0


def test_state_handed_back_holds_exactly_the_committed_tokens(perturbed, reference):
    _, engine = perturbed
    prompt = reference.tokenizer.encode(PROMPTS[4])
    seq = make_sequence(greedy_request("x", prompt, 40), reference.tokenizer)
    engine.admit(SequenceState(seq, make_prompt_cache(engine.registry.target.model), 0))
    engine.admit(make_sequence(greedy_request("y", prompt, 40), reference.tokenizer))
    for _ in range(6):
        engine.step()
    engine.settle()
    state, _ = engine.hand_over("x")
    assert all(layer.offset == state.cached for layer in state.cache)
    assert state.cached == len(seq.all_tokens) - 1
    engine.cancel("y")


def test_a_row_leaving_mid_prefill_carries_its_partial_cache_and_loses_no_output(
    perturbed, reference
):
    """A request whose prompt is still prefilling in a group (load fell to one and the
    scheduler hands it back to the single-stream engine) leaves with the positions its
    group has prefilled; the single-stream engine prefills the rest. Every token it
    generates reaches the caller as an output, and the output is solo decoding's."""
    spec, engine = perturbed  # prefill chunks of 64 tokens
    registry = engine.registry
    prompt = reference.tokenizer.encode(CODE_PROMPT * 4)
    assert len(prompt) > 2 * 64
    seq = make_sequence(greedy_request("mid", prompt, 12), registry.tokenizer)
    registry.transfer(engine.name)
    engine.admit(seq)
    published = [token for output in engine.step().outputs for token in output.token_ids]
    state, _ = engine.hand_over("mid")
    assert state.cached == 64 and not seq.generated, "left after one chunk, before its first token"
    assert not engine.groups and not engine.batch_size
    registry.transfer(spec.name)
    spec.take_over(state)
    while spec.active is not None:
        published += [token for output in spec.step().outputs for token in output.token_ids]
    registry.transfer(engine.name)
    assert seq.generated == reference.greedy_tokens(prompt, 12)
    assert published == seq.generated


def test_a_draft_model_row_drafts_no_more_than_its_own_num_draft_tokens(self_draft, reference):
    """Beside a row drafting 4, a request that asked for num_draft_tokens=1 drafts one
    token per step (before, every draft-model row drafted the batch's longest K)."""
    _, engine = self_draft
    a, b = (reference.tokenizer.encode(PROMPTS[i]) for i in (0, 2))
    requests = [
        greedy_request(
            "one", a, 40, speculation=SpeculationOverrides(num_draft_tokens=1, enable_pld=False)
        ),
        greedy_request(
            "four", b, 40, speculation=SpeculationOverrides(num_draft_tokens=4, enable_pld=False)
        ),
    ]
    seqs, _, _ = run_batch(engine, requests)
    assert seqs["one"].generated == reference.greedy_tokens(a, 40)
    assert seqs["four"].generated == reference.greedy_tokens(b, 40)
    one, four = seqs["one"].spec.by_method["draft"], seqs["four"].spec.by_method["draft"]
    assert one.drafts > 0 and one.draft_tokens == one.drafts, seqs["one"].spec.as_dict()
    assert four.draft_tokens > four.drafts  # the other row really drafted longer


def test_a_draft_model_row_drafts_no_further_than_its_max_tokens(self_draft, reference):
    """A row with two tokens left drafts at most one (the second comes from the verify);
    drafts past max_tokens would be counted as accepted though never emitted."""
    _, engine = self_draft
    a, b = (reference.tokenizer.encode(PROMPTS[i]) for i in (0, 2))
    no_pld = SpeculationOverrides(enable_pld=False)
    requests = [
        greedy_request("short", a, 3, speculation=no_pld),
        greedy_request("long", b, 40, speculation=no_pld),
    ]
    seqs, _, _ = run_batch(engine, requests)
    assert seqs["short"].generated == reference.greedy_tokens(a, 3)
    stats = seqs["short"].spec.by_method["draft"]
    assert stats.drafts > 0 and stats.draft_tokens <= stats.drafts, seqs["short"].spec.as_dict()
    assert stats.accepted_tokens <= 1


def test_greedy_draft_rows_chain_lazily_to_the_same_drafts_as_step_by_step(
    perturbed, reference, monkeypatch
):
    """Greedy draft-model rows draft as one lazy chain read once per proposal; it
    proposes exactly what reading each drafted position does (same drafts accepted at
    the same positions, rows of different draft lengths), and output stays exact."""
    _, engine = perturbed
    # prompts that prefill in one group: a prompt prefilled inside the rows' steps is
    # paced by time, so the two runs would take different steps
    prompts = [reference.tokenizer.encode(p) for p in (PROMPTS[0], PROMPTS[2], PROMPTS[3])]

    def requests():
        return [
            greedy_request(
                f"r{i}",
                p,
                36,
                speculation=SpeculationOverrides(num_draft_tokens=2 + i, enable_pld=False),
            )
            for i, p in enumerate(prompts)
        ]

    chained, _, drafted = run_batch(engine, requests())
    monkeypatch.setattr("engines.batched.drafting._greedy", lambda row: False)
    stepwise, _, _ = run_batch(engine, requests())
    assert drafted > 0
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        assert chained[rid].generated == stepwise[rid].generated == reference.greedy_tokens(p, 36)
        assert chained[rid].spec.as_dict() == stepwise[rid].spec.as_dict()
        assert chained[rid].spec.by_method["draft"].draft_tokens > 0
