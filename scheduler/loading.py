"""Loading the model and the single-stream engine that owns it first.

Whether speculation is possible is decided here, once: a model whose caches cannot
roll back rejected drafts (layers holding other caches) gets no drafting at all, and
the scheduler batches every request; one whose rows roll back alone in the batch
(plain KV, sliding-window and recurrent layers, with a plain-KV draft) drafts inside
the batch and migrates both ways."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from engines.cache.ragged_cache import warm_up
from engines.cache.rollback import (
    cuts_back_anywhere,
    supports_batched_rows,
    supports_rollback,
    supports_snapshot,
)
from engines.drafting.draft_vocab import reduce_draft_vocab
from engines.drafting.feature_drafters import (
    DrafterRefused,
    drafter_kind,
    load_feature_drafter,
)
from engines.gating.measured_costs import CostModel
from engines.model.mtp import (
    MTPUnavailable,
    load_head,
    local_folder,
    mtp_layers_in_config,
    weights_source,
)
from engines.model.registry import ModelRegistry
from engines.sample.constraints import GrammarCompiler
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from scheduler.config import SchedulerConfig
from scheduler.template_traits import RENDERS_ALL, TemplateTraits, dropped, probe_template

log = logging.getLogger(__name__)

# A model that cannot speculate never measures verify costs.
_NO_SPECULATION = CostModel.assumed(1)


@dataclass(frozen=True)
class ModelInfo:
    """What the server needs to know about the loaded model (no MLX arrays)."""

    path: str
    tokenizer: Any
    context_length: int | None
    has_draft: bool
    grammar: GrammarCompiler  # JSON schemas -> constraints for this tokenizer
    # token ids a request may hold: the model's embedding rows, fewer if the tokenizer has
    # fewer (MLX does not bounds-check an index: a larger id reads and writes out of bounds)
    vocab_size: int
    template_traits: TemplateTraits  # what its chat template renders, probed at load
    # caches that cannot be cut back to any prefix: chats keep one at their system prompt
    prompt_checkpoints: bool = False
    # a vision-language model's image half (engines.model.vision.VisionParts; the server
    # calls only its `expand`, the processor), None for a model that reads text only
    vision: Any = None


@dataclass
class Loaded:
    registry: ModelRegistry
    engine: SpeculativeEngine  # owns the model
    speculation_supported: bool  # drafting runs (at least one request at a time)
    # Caches trim (plain KV): batched speculation, pausing rows, migrating both ways.
    rows_roll_back: bool
    info: ModelInfo


def load_model(config: SchedulerConfig) -> Loaded:
    """Load the target (and draft), build the single-stream engine and hand it the
    model; warm the models up so the batched engine starts without a first-use stall.
    Runs on the engine thread (MLX streams are thread-local)."""
    log.info("loading model %s", config.model)
    kind = drafter_kind(config.draft_model, config.draft_kind) if config.draft_model else None
    if kind not in (None, "model") and config.distributed:
        raise DrafterRefused(
            f"--draft-model {config.draft_model}: a {kind} drafter reads the target's hidden "
            "states, which a sharded target (--distributed) keeps on other ranks; serve it "
            "without --distributed, or draft with a draft model"
        )
    registry = ModelRegistry.load(
        config.model,
        config.draft_model if kind == "model" else None,
        config.gguf_dtype,
        config.distributed,
    )
    if registry.target.vision is not None and config.max_tower_pixels is not None:
        registry.target.vision.tower_pixels = config.max_tower_pixels
    if kind not in (None, "model"):
        registry.feature_drafter = load_feature_drafter(config.draft_model, kind, registry.target)
        log.info("drafter: %s", registry.feature_drafter.describe())
    if registry.draft is not None:
        registry.draft.model = reduce_draft_vocab(
            registry.draft.model, registry.tokenizer, config.draft_vocab
        )
    target, draft = registry.target.model, registry.draft and registry.draft.model
    models = [m for m in (target, draft) if m]
    # batched rows: a hybrid target's recurrent rows restore and rerun; a draft is plain KV
    rows_roll_back = supports_batched_rows(target) and (not draft or supports_rollback(draft))
    drafting = all(supports_rollback(m) or supports_snapshot(m) for m in models)
    if not drafting:
        log.warning(
            "speculation off: this model's caches cannot roll back rejected drafts "
            "(they hold other caches); prompt lookup and any draft model are not used, "
            "and every request is served by plain continuous batching"
        )
        registry.draft = None  # never used: no request may draft on this model
        registry.feature_drafter = None
    elif not rows_roll_back:
        log.info(
            "recurrent or sliding-window caches: a rejected draft rolls back by restoring "
            "the state before the verify and replaying the accepted tokens; drafting runs "
            "while one request decodes, concurrent requests are batched plainly"
        )
    elif not supports_rollback(target):
        log.info(
            "recurrent or sliding-window layers: a rejected draft rolls back per request "
            "and per row of a batch (recurrent state restored and rerun on the kept "
            "tokens, a window kept in order in the batch); drafting stays on in the batch"
        )
    if drafting:
        attach_mtp(registry, config)
    engine = SpeculativeEngine(
        registry,
        SpecConfig.for_server(
            config.num_draft_tokens if drafting else 0,
            max_draft_tokens=SpecConfig.max_draft_tokens if drafting else 0,
            enable_pld=config.enable_pld and drafting,
            prefill_step_size=config.prefill_step_size,
        ),
        cost=config.cost_model or (None if drafting else _NO_SPECULATION),
    )
    registry.transfer(engine.name)
    log.info("speculation: %s", engine.describe())
    if rows_roll_back:  # the batched speculative engine starts lazily, warm already
        for model in models:
            warm_up(model)
    traits = probe_template(registry.tokenizer)
    if traits != RENDERS_ALL:
        log.info("the chat template drops %s; rendering them as text", dropped(traits))
    info = ModelInfo(
        path=config.model,
        tokenizer=registry.tokenizer,
        context_length=registry.target.context_length,
        has_draft=any(
            d is not None for d in (registry.draft, registry.mtp, registry.feature_drafter)
        ),
        grammar=GrammarCompiler(registry.tokenizer),
        vocab_size=min(len(registry.tokenizer), registry.target.vocab_size),
        template_traits=traits,
        prompt_checkpoints=not cuts_back_anywhere(target),
        vision=registry.target.vision,
    )
    info.grammar.warm_in_background()
    return Loaded(registry, engine, drafting, rows_roll_back, info)


def attach_mtp(registry: ModelRegistry, config: SchedulerConfig) -> None:
    """Load the target's own MTP head into `registry.mtp` when it has one and it will
    draft: not with --no-mtp, a draft model (one model drafter at a time) or ranks.
    Weights asked for with --mtp-weights must load; a model whose converted files
    lost the head is served without it, and the log says how to bring it back."""
    target = registry.target
    declared = mtp_layers_in_config(target.config) > 0
    if not (declared or config.mtp_weights):
        return
    drafter = registry.draft or registry.feature_drafter
    if not config.mtp or drafter is not None or config.distributed:
        reason = (
            "--no-mtp"
            if not config.mtp
            else "--draft-model drafts instead"
            if drafter is not None
            else "not with --distributed"
        )
        log.info("MTP head: not used (%s)", reason)
        return
    weights = weights_source(config.mtp_weights) if config.mtp_weights else None
    try:  # an architecture Tandem builds no head for is refused by load_head too
        registry.mtp = load_head(target.model, target.config, local_folder(target.folder), weights)
    except MTPUnavailable as exc:
        if weights is not None:
            raise
        log.warning("MTP head: not used: %s", exc)
        return
    log.info("MTP head: loaded; it drafts (depth chained up to k, --no-mtp turns it off)")
