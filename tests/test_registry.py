"""Model loading and the draft compatibility check."""

from __future__ import annotations

import pytest

from engines.errors import DraftIncompatible
from engines.model.demo import build_tiny_model
from engines.model.registry import ModelRegistry


def test_loads_target_and_compatible_draft(tiny_model_dir, tiny_draft_dir):
    registry = ModelRegistry.load(str(tiny_model_dir), str(tiny_draft_dir))
    assert registry.draft is not None
    assert registry.target.context_length == 2048
    assert registry.owner is None


def test_refuses_draft_with_different_vocabulary_naming_both_sizes(tiny_model_dir, tmp_path):
    other = build_tiny_model(tmp_path / "other-vocab", vocab_size=600)
    with pytest.raises(DraftIncompatible) as info:
        ModelRegistry.load(str(tiny_model_dir), str(other))
    message = str(info.value)
    assert "600" in message and "512" in message


def test_transfer_records_the_owner(tiny_model_dir):
    registry = ModelRegistry.load(str(tiny_model_dir))
    assert registry.transfer("plain") is None
    assert registry.transfer("batched") == "plain"
    registry.check_owner("batched")
