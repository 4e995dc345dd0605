"""The batch's model drafter, of the kind the model's speculation setup chose
(`engines.drafting.kinds`): the draft model's rows, the MTP head's, or a feature
drafter's. Each answers the same calls (join, prefill, draft, copy, leave, check,
recover), so the engine never asks which kind it has."""

from __future__ import annotations

from typing import Any

from engines.batched.assistant_rows import AssistantRows
from engines.batched.drafting import DraftModelRows
from engines.batched.feature_rows import Eagle3Rows, FeatureRows
from engines.batched.mtp import BatchedMTP
from engines.drafting.draft import ASSISTANT, DFLASH, DRAFT, EAGLE3
from engines.drafting.kinds import ModelDrafterSetup
from engines.model.registry import ModelRegistry


def rows_drafter(
    setup: ModelDrafterSetup | None, registry: ModelRegistry, guarded: Any, chunk: int
) -> Any:
    """The row drafter for `setup`'s kind; `guarded` is the batch's own target (a
    drafter fed its hidden states runs the batch's target forwards)."""
    if setup is None:
        return None
    if setup.method == DRAFT:
        return DraftModelRows(registry.draft.model, setup.vocab_size, chunk)
    if setup.method == DFLASH:
        return FeatureRows(setup, guarded)
    if setup.method == ASSISTANT:
        return AssistantRows(setup.single, setup.features, guarded, setup.vocab_size)
    if setup.method == EAGLE3:
        return Eagle3Rows(setup.single, setup.features, guarded, setup.vocab_size)
    return BatchedMTP(setup.single, setup.features, guarded, setup.vocab_size)
