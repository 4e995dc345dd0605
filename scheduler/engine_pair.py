"""The two engines that share one model, and which of them owns it now.

The single-stream speculative engine is built at load and owns the model while at
most one request runs; the batched engine (batched speculation where rows roll back,
else mlx-lm's BatchGenerator) starts the first time two requests are active at once.
`switch` hands the model over between steps, carrying in-flight requests with their
KV caches, so a migration never re-prefills.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engines.batched.engine import BatchedSpeculativeEngine
from engines.batched.fallback import BatchedEngine
from engines.drafting.draft_vocab import vocabulary_of
from engines.interface import Engine, StepResult
from engines.model.registry import ModelRegistry
from engines.single.engine import SpeculativeEngine
from engines.state import SequenceState
from scheduler.config import SchedulerConfig
from scheduler.loading import Loaded
from scheduler.policy import Mode

log = logging.getLogger(__name__)


class EnginePair:
    """The engines and the mode. Owned by the engine thread: `spec`, `batched`, `mode`
    and `registry` change there only (at load and in `switch`); other threads read the
    stats properties, whose dicts are built from engine fields (a stale value is
    harmless)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.registry: ModelRegistry | None = None
        self.spec: SpeculativeEngine | None = None
        self.batched: BatchedSpeculativeEngine | BatchedEngine | None = None
        self.mode = Mode.SPECULATIVE
        self.checkpoint_prompts = False  # keep prompt checkpoints (see `load`)
        self.speculation_supported = True  # drafting can run (decided at load)
        self.rows_roll_back = True  # caches trim: batched speculation, pauses, migration

    def load(self, loaded: Loaded, prefix_cache: bool) -> None:
        """Take the loaded model and its single-stream engine. Prompt checkpoints: only
        for a prefix cache, only where caches cannot be cut back to any prefix (plain
        KV needs none, and copying rows out would be waste)."""
        self.registry, self.spec = loaded.registry, loaded.engine
        self.checkpoint_prompts = prefix_cache and loaded.info.prompt_checkpoints
        self.spec.checkpoint_prompts = self.checkpoint_prompts
        self.speculation_supported = loaded.speculation_supported
        self.rows_roll_back = loaded.rows_roll_back

    @property
    def engine(self) -> Engine | None:
        """The engine that owns the model now."""
        return self.spec if self.mode == Mode.SPECULATIVE else self.batched

    def switch(
        self,
        target: Mode,
        absorb: Callable[[StepResult], None],
        take_over: Callable[[SequenceState], bool],
    ) -> int:
        """Hand the model to the other engine, carrying in-flight requests with their
        KV caches; `absorb` gets what settling a step in flight produced, `take_over`
        puts a request into the batched engine (False when it failed there). Between
        steps on the engine thread: no forward is in progress. Returns how many
        requests migrated."""
        migrated = 0
        if target == Mode.BATCHED:
            if self.batched is None:
                self.batched = self._make_batched()
                log.info("started the batched engine (first time two requests are active)")
            for request_id in self.spec.active_ids:
                state, result = self.spec.hand_over(request_id)
                absorb(result)
                if state is not None:
                    self.registry.transfer(BatchedEngine.name)
                    migrated = int(take_over(state))
            self.registry.transfer(BatchedEngine.name)
        else:
            if self.batched is not None:
                absorb(self.batched.settle())  # a plain step in flight commits first
            remaining = self.batched.active_ids if self.batched else []
            assert len(remaining) <= 1, "only a single request migrates back"
            self.registry.transfer(SpeculativeEngine.name)
            for request_id in remaining:
                state, result = self.batched.hand_over(request_id)
                absorb(result)
                self.spec.take_over(state)
                migrated += 1
        self.mode = target
        return migrated

    def _make_batched(self) -> BatchedSpeculativeEngine | BatchedEngine:
        """Batched speculation when the caches roll back per row; otherwise mlx-lm's
        BatchGenerator, which batches any cache type but cannot verify drafts."""
        config = self.config
        if self.rows_roll_back:
            engine = BatchedSpeculativeEngine(
                self.registry, self.spec.speculation, config.batch_prefill_step_size
            )
            engine.checkpoint_prompts = self.checkpoint_prompts
            return engine
        return BatchedEngine(self.registry, config.max_num_seqs, config.batch_prefill_step_size)

    # ---- stats (read from any thread) -----------------------------------------------

    @property
    def ranks(self) -> int:
        """Processes serving the model: more than 1 with --distributed."""
        lockstep = self.registry.lockstep if self.registry is not None else None
        return lockstep.ranks if lockstep is not None else 1

    @property
    def drafters(self) -> list[str]:
        """The drafters requests may use: "pld", and "draft" or "mtp" (the model drafter)."""
        spec = self.spec
        if spec is None:
            return []
        methods = ["pld"] if spec.config.enable_pld else []
        return methods + ([spec.drafter.method] if spec.drafter is not None else [])

    @property
    def draft_vocabulary(self) -> dict | None:
        """How much of its vocabulary the draft model scores (`--draft-vocab`): the kept
        rows of how many; None without a draft model or when it scores them all."""
        draft = self.registry.draft if self.registry is not None else None
        return vocabulary_of(draft.model) if draft is not None else None

    @property
    def speculation_costs(self) -> dict | None:
        """The single-stream cost model in use (verify and draft-step costs relative to a
        plain step), what was measured at start-up, and how many steps taught it; and the
        batched engine's forward costs in seconds and its measured/predicted calibration
        by batch size and kind of step (None until it starts); and how often the draft
        model's tokens are accepted by how sure it was (None without a draft model)."""
        spec = self.spec
        if spec is None:
            return None
        realized = spec.realized
        batched = self.batched
        return {
            **spec.costs.snapshot(),
            "realized_tokens_per_s": realized.snapshot() if realized is not None else None,
            "draft_confidence": (spec.confidence.snapshot() if spec.drafter is not None else None),
            "batched": (
                batched.costs.as_dict() if isinstance(batched, BatchedSpeculativeEngine) else None
            ),
        }
