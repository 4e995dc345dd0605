"""The batched engine's shared samplers: one per set of sampler parameters, bounded."""

from __future__ import annotations

from engines.batched.fallback import SamplerPool
from engines.request import GenerationRequest, SamplingParams
from engines.sequence import make_sequence


def sequence(tokenizer, params: SamplingParams, rid: str = "r"):
    return make_sequence(GenerationRequest(rid, (1, 2, 3), 4, params), tokenizer)


def test_logit_bias_does_not_split_or_grow_the_pool(reference):
    """Bias and penalties are logits processors, not part of the sampler: requests that
    differ only there share one sampler (so their rows sample in one call)."""
    pool = SamplerPool()
    samplers = {
        id(pool.sampler_for(sequence(reference.tokenizer, params, f"b{i}")))
        for i, params in enumerate(
            SamplingParams(temperature=0.7, logit_bias=((i, 1.5), (i + 1, -2.0)))
            for i in range(1000)
        )
    }
    assert len(samplers) == 1
    assert len(pool) == 1


def test_distinct_sampler_parameters_are_bounded(reference):
    pool = SamplerPool()
    for i in range(1000):
        pool.sampler_for(sequence(reference.tokenizer, SamplingParams(temperature=0.5 + i / 1e4)))
    assert len(pool) <= pool.max_size < 1000
