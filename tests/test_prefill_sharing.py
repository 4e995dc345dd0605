"""A prompt that arrives while others decode prefills inside their steps: each chunk
rides in the decoding rows' forward (`engines/batched/packed_forward.py`), sized by the
pacer (`engines/prefill_pacing.py`), so no decoding row misses a step while it prefills, and
every row's output is still plain greedy decoding's."""

from __future__ import annotations

import pytest

from engines.batched.step_plan import StepKind
from engines.prefill_pacing import FLOOR
from tests.test_batched_speculation import CODE_PROMPT, PROMPTS, greedy_request, make_engines


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return make_engines(tiny_model_dir)


@pytest.fixture(scope="module")
def drafting(tiny_model_dir, perturbed_draft_dir):
    return make_engines(tiny_model_dir, perturbed_draft_dir)


def serve(engine, running, arriving, arrive_at: int):
    """Step until all finish; `arriving` joins after `arrive_at` steps. Returns each
    request's tokens and, per step after the arrival until its first token, whether
    every running row got a token in that step, what kind of step it was and whether
    the pacer had measured a decode step by then."""
    from engines.sequence import make_sequence

    tokenizer = engine.registry.tokenizer
    tokens = {r.request_id: [] for r in [*running, arriving]}
    for request in running:
        engine.admit(make_sequence(request, tokenizer))
    steps, step = [], 0
    while engine.batch_size or step <= arrive_at:
        if step == arrive_at:
            engine.admit(make_sequence(arriving, tokenizer))
        waiting = step >= arrive_at and not tokens[arriving.request_id]
        result = engine.step()
        got = {o.request_id for o in result.outputs if o.token_ids}
        for output in result.outputs:
            tokens[output.request_id] += output.token_ids
        if waiting:
            alive = [r.request_id for r in running if len(tokens[r.request_id]) < r.max_tokens]
            measured = engine.pacer.decode_seconds is not None
            steps.append((all(rid in got for rid in alive), engine._last, measured))
        step += 1
        assert step < 2000
    return tokens, steps


@pytest.mark.parametrize("engines", ["plain", "drafting"])
def test_rows_keep_decoding_every_step_while_a_long_prompt_prefills(engines, request, reference):
    _, engine = request.getfixturevalue(engines)
    assert engine.packing  # the tiny Llama packs
    tokenizer = reference.tokenizer
    running = [greedy_request(f"r{i}", tokenizer.encode(p), 40) for i, p in enumerate(PROMPTS[:2])]
    long_prompt = tokenizer.encode(CODE_PROMPT * 8)[:300]
    arriving = greedy_request("long", long_prompt, 6)
    tokens, steps = serve(engine, running, arriving, arrive_at=3)

    for r in [*running, arriving]:
        assert tokens[r.request_id] == reference.greedy_tokens(list(r.prompt_tokens), r.max_tokens)
    # prefilling took several chunks, and no running row missed a step meanwhile
    assert len(long_prompt) == 300 and len(steps) >= 300 // engine.prefill_step_size
    assert all(every_row_got_a_token for every_row_got_a_token, _, _ in steps), steps
    assert StepKind.PREFILL not in {kind for _, kind, _ in steps}
    assert FLOOR <= engine.pacer.next_chunk(decoding=True) <= engine.prefill_step_size


def test_without_packing_chunks_alternate_with_the_rows_steps(tiny_model_dir, reference):
    _, engine = make_engines(tiny_model_dir)
    engine.packing = False  # as for a model that cannot pack (sliding windows, hybrids)
    tokenizer = reference.tokenizer
    running = [greedy_request("r0", tokenizer.encode(PROMPTS[0]), 40)]
    arriving = greedy_request("long", tokenizer.encode(CODE_PROMPT * 8)[:300], 6)
    tokens, steps = serve(engine, running, arriving, arrive_at=3)
    for r in [*running, arriving]:
        assert tokens[r.request_id] == reference.greedy_tokens(list(r.prompt_tokens), r.max_tokens)
    kinds = [kind for _, kind, _ in steps]
    assert StepKind.PREFILL in kinds and StepKind.VERIFY in kinds
    assert not all(every_row_got_a_token for every_row_got_a_token, _, _ in steps)


def test_a_prompt_arriving_before_any_decode_step_is_measured_gets_paced(tiny_model_dir, reference):
    """The rows' first steps already carry the newcomer's chunks: the engine runs one
    step without a chunk first, so the pacer sizes the chunks by a measured decode step
    instead of keeping its first guess for the whole prompt."""
    _, engine = make_engines(tiny_model_dir)
    tokenizer = reference.tokenizer
    running = [greedy_request(f"r{i}", tokenizer.encode(p), 40) for i, p in enumerate(PROMPTS[:2])]
    arriving = greedy_request("long", tokenizer.encode(CODE_PROMPT * 8)[:300], 6)
    tokens, steps = serve(engine, running, arriving, arrive_at=1)
    for r in [*running, arriving]:
        assert tokens[r.request_id] == reference.greedy_tokens(list(r.prompt_tokens), r.max_tokens)
    assert all(measured for _, _, measured in steps), steps
