"""With drafting off (k = 0) the speculative engine is plain decoding, and plain
decoding is bit-identical to mlx-lm's own decode loop."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import generate
from mlx_lm.sample_utils import make_logits_processors

from engines.gating.measured_costs import CostModel
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams
from engines.sequence import FinishReason, make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    registry = ModelRegistry.load(str(tiny_model_dir))
    config = SpecConfig(num_draft_tokens=0, enable_pld=False, prefill_step_size=16)
    engine = SpeculativeEngine(registry, config, cost=CostModel.assumed(9))
    registry.transfer(engine.name)
    return engine


def run(engine: SpeculativeEngine, request: GenerationRequest):
    seq = make_sequence(request, engine.registry.tokenizer)
    engine.admit(seq)
    outputs = []
    while engine.active is not None:
        outputs.extend(engine.step().outputs)
    return seq, outputs


def greedy(prompt_ids, max_tokens, **kw) -> GenerationRequest:
    return GenerationRequest(
        "r", tuple(prompt_ids), max_tokens, SamplingParams(temperature=0.0), **kw
    )


def test_greedy_equals_mlx_lm_generate_step_across_chunked_prefill(engine, reference):
    prompt = reference.tokenizer.encode("def add(a, b):\n    return a + b\n" * 3)
    assert len(prompt) > 16, "prompt must span several prefill chunks"
    seq, _ = run(engine, greedy(prompt, 120, ignore_eos=True))
    assert seq.generated == reference.greedy_tokens(prompt, 120)


def test_greedy_with_repetition_penalty_equals_mlx_lm(engine, reference):
    prompt = reference.tokenizer.encode("Once upon a time")
    request = GenerationRequest(
        "r",
        tuple(prompt),
        60,
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        ignore_eos=True,
    )
    seq, _ = run(engine, request)
    processors = make_logits_processors(repetition_penalty=1.3)
    expected = reference.greedy_tokens(prompt, 60, logits_processors=processors)
    assert seq.generated == expected


def test_eos_finishes_with_stop_and_is_counted_but_not_decoded(engine, reference):
    prompt = reference.tokenizer.encode("Hello, world!")
    expected = reference.greedy_until_eos(prompt, 400)
    assert expected[-1] in reference.tokenizer.eos_token_ids, "fixture should reach EOS"
    seq, outputs = run(engine, greedy(prompt, 400))
    assert seq.generated == expected
    assert seq.finish_reason == FinishReason.STOP
    text = "".join(o.text for o in outputs)
    assert text == generate(reference.model, reference.tokenizer, prompt, max_tokens=400)


def test_max_tokens_gives_exactly_that_many_tokens(engine, reference):
    prompt = reference.tokenizer.encode("Once upon a time")
    seq, outputs = run(engine, greedy(prompt, 7, ignore_eos=True))
    assert len(seq.generated) == 7
    assert outputs[-1].finish_reason == FinishReason.LENGTH


def test_stop_string_cuts_text_and_ends_generation(engine, reference):
    prompt = reference.tokenizer.encode("Once upon a time")
    full = reference.tokenizer.decode(reference.greedy_tokens(prompt, 40))
    stop = full[10:13]
    seq, outputs = run(engine, greedy(prompt, 40, ignore_eos=True, stop=(stop,)))
    text = "".join(o.text for o in outputs)
    assert seq.finish_reason == FinishReason.STOP and seq.matched_stop == stop
    assert text == full[: full.index(stop)]
    assert len(seq.generated) < 40


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine, reference):
    prompt = reference.tokenizer.encode("Once upon a time")

    def sample(seed):
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        seq, _ = run(engine, GenerationRequest("r", tuple(prompt), 40, params, ignore_eos=True))
        return seq.generated

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_cancel_frees_the_engine(engine, reference):
    prompt = reference.tokenizer.encode("Once upon a time")
    seq = make_sequence(greedy(prompt, 100, ignore_eos=True), engine.registry.tokenizer)
    engine.admit(seq)
    for _ in range(3):
        engine.step()
    assert engine.cancel("r")
    assert engine.has_capacity and seq.finish_reason == FinishReason.CANCELLED


def test_forward_without_ownership_raises(engine, reference):
    from engines.model.registry import OwnershipError

    engine.registry.transfer("someone-else")
    try:
        prompt = reference.tokenizer.encode("Once upon a time")
        engine.admit(make_sequence(greedy(prompt, 5), engine.registry.tokenizer))
        with pytest.raises(OwnershipError):
            engine.step()
        engine.cancel("r")
    finally:
        engine.registry.transfer(engine.name)
    mx.clear_cache()
