"""Loads the target (and optional draft) model once and records who owns it.

One model instance is shared by every engine. Only the owner may run a forward
pass; ownership moves only at a step boundary, on the engine thread. Engines call
`check_owner` before each forward, so a violation fails loudly instead of two
engines silently interleaving work on one KV-cache-carrying model.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.cache.ragged_cache import trimmable_windows
from engines.distributed.lockstep import LockstepModel, distributed_group, load_shard
from engines.errors import DraftIncompatible
from engines.model.gguf_import import import_gguf, is_gguf
from engines.model.packaged_models import CATALOGUE, packaged_gguf
from engines.model.vision import VisionParts, is_vision_config, load_vision_model, vision_support
from engines.platform import cpu_attention

log = logging.getLogger(__name__)

_CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "n_ctx", "seq_length")


@dataclass
class LoadedModel:
    path: str
    model: Any  # mlx.nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict
    folder: str = ""  # what mlx-lm loaded: a local folder or a hub id
    vision: VisionParts | None = None  # a vision-language model's image half

    @property
    def context_length(self) -> int | None:
        for key in _CONTEXT_KEYS:
            value = self.config.get(key) or self.config.get("text_config", {}).get(key)
            if isinstance(value, int) and value > 0:
                return value
        return None

    @property
    def vocab_size(self) -> int:
        size = self.config.get("vocab_size") or self.config.get("text_config", {}).get("vocab_size")
        return int(size) if size else len(self.tokenizer)


def load_model(
    path: str, gguf_dtype: str | None = None, distributed: str | None = None
) -> LoadedModel:
    """Load through `mlx_lm.load`, exactly as users of mlx-lm would, from what
    `model_folder` makes of `path` (a vision-language checkpoint through mlx-vlm, its
    language half as mlx-lm's model: `engines.model.vision`); with `distributed`
    ("tensor" or "pipeline"), this rank's shard through mlx-lm's `sharded_load`,
    wrapped so the other ranks repeat its forwards (`lockstep`)."""
    from mlx_lm import load

    folder = model_folder(path, gguf_dtype)
    if distributed:
        group = distributed_group()
        model, tokenizer, config = load_shard(folder, distributed, group)
        model = LockstepModel(model, group)
        return LoadedModel(path, model, tokenizer, config, folder)
    config = local_config(folder)
    vision, reason = None, vision_support(config) if is_vision_config(config) else None
    if reason:
        log.warning("%s: served text-only: %s", path, reason)
    if is_vision_config(config) and not reason:
        model, tokenizer, vision = load_vision_model(folder, config)
    else:
        model, tokenizer, config = load(folder, return_config=True)
    trimmable_windows(model)  # sliding windows roll back without a replay
    cpu_attention.install(model)  # a CPU device's attention on every core
    return LoadedModel(path, model, tokenizer, config, folder, vision)


def local_config(folder: str) -> dict:
    """A local folder's config.json ({} for a hub id: mlx-lm fetches it)."""
    config = Path(folder).expanduser() / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def model_folder(path: str, gguf_dtype: str | None = None) -> str:
    """What mlx-lm loads for `path`: a GGUF file, or a catalogue name such as
    `qwen2.5-coder-0.5b` (`packaged_models`, fetched once), becomes a cached mlx-lm
    folder (`gguf_import`); a folder or hub id passes through; a local path that is
    neither is refused with a message a person can act on."""
    local = Path(path).expanduser()
    if not local.exists() and path in CATALOGUE:
        local = packaged_gguf(CATALOGUE[path])
    if local.is_file():
        if not is_gguf(local):
            raise ValueError(
                f"{path} is a file but not GGUF; give an mlx-lm model directory "
                "(config.json and *.safetensors, e.g. from mlx_lm.convert) or a .gguf file"
            )
        return str(import_gguf(local, dtype=gguf_dtype))
    if path.startswith(("/", "./", "../", "~")) and not local.exists():
        raise FileNotFoundError(f"no model directory at {path}")
    return path


def check_draft_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft that cannot speak the target's tokens."""
    target_vocab, draft_vocab = len(target.tokenizer), len(draft.tokenizer)
    if target_vocab != draft_vocab:
        raise DraftIncompatible(
            f"draft model {draft.path!r} has a tokenizer with {draft_vocab} tokens but the "
            f"target {target.path!r} has {target_vocab}; they must share one tokenizer"
        )
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise DraftIncompatible(
            f"draft model {draft.path!r} and target {target.path!r} both have {target_vocab} "
            "tokens, but their vocabularies map tokens to different ids"
        )
    if draft.vocab_size < target_vocab:
        raise DraftIncompatible(
            f"draft model {draft.path!r} outputs {draft.vocab_size} logits, fewer than the "
            f"{target_vocab} tokens of the shared tokenizer (target outputs {target.vocab_size})"
        )


class OwnershipError(RuntimeError):
    """An engine tried to run the model without owning it."""


class GuardedModel:
    """The shared model as one engine sees it: every forward checks ownership first.

    Engines (and mlx-lm's BatchGenerator, which the batched engine hands this to)
    only ever call the model through their own guard, so a forward pass by an engine
    that does not own the model raises instead of silently interleaving."""

    def __init__(self, registry: ModelRegistry, model: Any, engine_name: str) -> None:
        self._registry = registry
        self._model = model
        self._engine_name = engine_name

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self.guard(inputs)
        return self._model(inputs, *args, **kwargs)

    def guard(self, inputs: Any) -> None:
        """What every forward does first; a caller that runs the model in parts (the
        MTP head needs hidden states) calls it itself."""
        self._registry.check_owner(self._engine_name)
        self._registry.tokens_processed += inputs.size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class ModelRegistry:
    """The shared target/draft models and the record of which engine owns them."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None) -> None:
        if draft is not None:
            check_draft_compatible(target, draft)
        self.target = target
        self.draft = draft
        self.mtp: Any = None  # the target's own MTP head (engines.model.mtp), when loaded
        # a drafter fed the target's hidden states (DFlash, EAGLE-3), when --draft-model
        # names one (`engines.drafting.feature_drafters`)
        self.feature_drafter: Any = None
        self.owner: str | None = None
        self.tokens_processed = 0  # token positions fed to the target by all engines

    @classmethod
    def load(
        cls,
        target_path: str,
        draft_path: str | None = None,
        gguf_dtype: str | None = None,
        distributed: str | None = None,
    ) -> ModelRegistry:
        """With `distributed`, the target is sharded across the launched ranks; the
        draft model is whole, and lives on rank 0 only."""
        target = load_model(target_path, gguf_dtype, distributed)
        draft = load_model(draft_path, gguf_dtype) if draft_path else None
        return cls(target, draft)

    @property
    def lockstep(self) -> LockstepModel | None:
        """The sharded target's command channel, when serving across ranks."""
        model = self.target.model
        return model if isinstance(model, LockstepModel) else None

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    def model_for(self, engine_name: str) -> GuardedModel:
        """The target model, callable only while `engine_name` owns it."""
        return GuardedModel(self, self.target.model, engine_name)

    def transfer(self, engine_name: str) -> str | None:
        """Give the model to `engine_name`; returns the previous owner."""
        previous, self.owner = self.owner, engine_name
        if previous != engine_name:
            log.debug("model ownership %s -> %s", previous, engine_name)
        return previous

    def check_owner(self, engine_name: str) -> None:
        if self.owner != engine_name:
            raise OwnershipError(
                f"engine {engine_name!r} tried to run the model while {self.owner!r} owns it"
            )
