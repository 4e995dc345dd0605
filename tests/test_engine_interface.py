"""Every engine is driven through one interface (`engines.interface.Engine`): the same
operation names, and each call's products in its `StepResult`, never in side lists."""

from __future__ import annotations

import pytest

from engines.batched.engine import BatchedSpeculativeEngine
from engines.batched.fallback import BatchedEngine
from engines.gating.measured_costs import CostModel
from engines.interface import Engine, StepResult
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams
from engines.sequence import make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig

OLD_NAMES = ("add", "insert", "extract", "export", "resume", "released", "checkpoints")
OLD_NAMES += ("step_sizes", "forward_seconds", "settled", "cost")


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    registry = ModelRegistry.load(str(tiny_model_dir))
    spec = SpeculativeEngine(registry, SpecConfig(), cost=CostModel.assumed(9))
    return {
        "speculative": spec,
        "batched": BatchedSpeculativeEngine(registry, spec.speculation, prefill_step_size=64),
        "fallback": BatchedEngine(registry),
    }


@pytest.mark.parametrize("kind", ["speculative", "batched", "fallback"])
def test_each_engine_implements_the_interface_under_one_name_per_operation(engines, kind):
    engine = engines[kind]
    assert isinstance(engine, Engine)
    assert [name for name in OLD_NAMES if hasattr(engine, name)] == []


@pytest.mark.parametrize("source, target", [("speculative", "batched"), ("batched", "fallback")])
def test_a_sequence_handed_over_finishes_exactly_and_its_cache_comes_back_in_a_result(
    engines, reference, source, target
):
    first, second = engines[source], engines[target]
    registry = first.registry
    prompt = reference.tokenizer.encode("Once upon a time there was")
    request = GenerationRequest("r", tuple(prompt), 24, SamplingParams(temperature=0.0))
    seq = make_sequence(request, registry.tokenizer)
    registry.transfer(first.name)
    first.admit(seq)
    published = []
    while len(seq.generated) < 8:
        result = first.step()
        assert isinstance(result, StepResult)
        published += [t for o in result.outputs for t in o.token_ids]
    state, result = first.hand_over("r")
    published += [t for o in result.outputs for t in o.token_ids]
    assert first.active_ids == [] and state is not None
    assert state.cached == len(seq.all_tokens) - 1, "its cache holds all but the newest token"
    registry.transfer(second.name)
    second.take_over(state)
    released = []
    while second.active_ids:
        result = second.step()
        published += [t for o in result.outputs for t in o.token_ids]
        released += result.released
    assert seq.generated == reference.greedy_tokens(prompt, 24) == published
    assert [s.seq.request_id for s in released] == ["r"], "the finished cache, once"
    assert released[0].cached <= len(seq.all_tokens)
    assert second.settle().outputs == [] and second.step().outputs == []


def test_drafters_of_each_shape_share_one_propose():
    """Lookup drafters take `propose(context, k)`; model drafters take the request's
    state, settings and RNG: each shape one signature (`engines/drafting/draft.py`)."""
    import inspect

    from engines.drafting.draft import Drafter, ModelDrafter
    from engines.drafting.draft_model import DraftModelDrafter
    from engines.drafting.mtp import MTPDrafter
    from engines.drafting.prompt_lookup import PromptLookupDrafter
    from engines.drafting.suffix import SuffixIndex

    def parameters(cls) -> list[str]:
        return list(inspect.signature(cls.propose).parameters)

    assert parameters(PromptLookupDrafter) == parameters(SuffixIndex) == parameters(Drafter)
    assert parameters(DraftModelDrafter) == parameters(MTPDrafter) == parameters(ModelDrafter)
