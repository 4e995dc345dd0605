"""Which model drafts for a loaded model: the one place that decides it.

A model drafter is one of the drafter kinds: a draft model (a small language model
of the same tokenizer), the target's own MTP head, or a drafter fed the target's
hidden states (`engines.drafting.feature_drafters`: DFlash, EAGLE-3). One drafts at a
time. `model_drafter` builds the single-stream drafter of that kind and what the
cost measurement times; the batch builds its row drafter of the same kind from the
same setup (`engines.batched.row_drafters`). Adding a kind is a module in this package
and a branch here and there, nothing in the engines' loops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.drafting.assistant import AssistantDrafter, AssistantStepModel
from engines.drafting.draft import ASSISTANT, EAGLE3, ModelDrafter
from engines.drafting.draft_model import DraftModelDrafter
from engines.drafting.feature_drafters import (
    DFlashDrafter,
    DFlashStepModel,
    Eagle3Drafter,
    Eagle3StepModel,
    FeatureDrafter,
)
from engines.drafting.mtp import MTPDrafter
from engines.model.mtp import MTPStepModel, TargetParts
from engines.model.registry import ModelRegistry


@dataclass(frozen=True)
class ModelDrafterSetup:
    """The model drafter of a loaded model, for every engine.

    `features` is how a target forward yields what the drafter is fed (the MTP head's
    hidden states, a feature drafter's tapped layers): None for a draft model, which
    feeds itself. `step_model` is what the start-up cost measurement times as one
    draft step (shaped like a model: `model(tokens, cache)`, `make_cache()`)."""

    method: str
    single: ModelDrafter
    step_model: Any
    features: Any = None
    vocab_size: int = 0  # the logits a draft scores: the target's and drafter's shared rows
    block: bool = False  # a proposal is one drafter forward, whatever its length (DFlash)


def model_drafter(registry: ModelRegistry, vocab_size: int, chunk: int) -> ModelDrafterSetup | None:
    """The model drafter `registry` loaded: its draft model, its feature drafter, or
    else the target's MTP head; None when nothing but lookup drafts."""
    if registry.draft is not None:
        vocab = min(registry.draft.vocab_size, vocab_size)
        drafter = DraftModelDrafter(registry.draft.model, vocab, chunk)
        return ModelDrafterSetup(drafter.method, drafter, registry.draft.model, None, vocab)
    if registry.feature_drafter is not None:
        return feature_setup(registry.feature_drafter, vocab_size)
    if registry.mtp is not None:
        parts = TargetParts(registry.target.model)
        drafter = MTPDrafter(registry.mtp, parts, vocab_size)
        return ModelDrafterSetup(
            drafter.method, drafter, MTPStepModel(registry.mtp, parts), parts, vocab_size
        )
    return None


def feature_setup(loaded: FeatureDrafter, vocab_size: int) -> ModelDrafterSetup:
    """The setup of a loaded feature drafter: fed the tapped layers of every forward."""
    if loaded.kind == ASSISTANT:
        assistant = AssistantDrafter(loaded, vocab_size)
        step = AssistantStepModel(assistant, loaded.taps.model, loaded.feature_width)
        return ModelDrafterSetup(assistant.method, assistant, step, loaded.taps, vocab_size)
    if loaded.kind == EAGLE3:
        chain = Eagle3Drafter(loaded, vocab_size)
        step = Eagle3StepModel(chain)
        return ModelDrafterSetup(chain.method, chain, step, loaded.taps, vocab_size)
    drafter = DFlashDrafter(loaded, vocab_size)
    step = DFlashStepModel(loaded)
    return ModelDrafterSetup(drafter.method, drafter, step, loaded.taps, vocab_size, block=True)
