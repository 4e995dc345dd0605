"""The speculation setup of one loaded model, built once at load and handed to both
engines: what drafting is configured with, the limits a request drafts within, the
measured costs, the draft model's calibration, and the model drafter.

Before, the batched engine borrowed these from the single-stream engine's instance,
so "which model drafts" was decided in each engine and a migrating request depended
on both agreeing. Now both read one `Speculation`: a request keeps the same limits,
gates and costs whichever engine serves it, and a drafter kind is chosen in one
place (`engines.drafting.kinds.model_drafter`).

Owned by the engine thread: both engines run there, and every field here is read and
changed only on it (the scheduler's stats read snapshots taken there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engines.drafting.draft import ModelDrafter
from engines.drafting.kinds import ModelDrafterSetup, model_drafter
from engines.gating.draft_confidence import ConfidenceCalibration
from engines.gating.draft_limits import DraftLimits
from engines.gating.measured_costs import CostModel, OnlineCosts, RealizedRates
from engines.model.registry import ModelRegistry
from engines.spec_config import SpecConfig
from engines.telemetry import SpecStats


@dataclass
class Speculation:
    config: SpecConfig
    totals: SpecStats  # lifetime counters for /metrics
    limits: DraftLimits  # what each request may draft, and its first gates
    costs: OnlineCosts  # verify and draft costs, measured at load, learned as served
    # what drafting with the model drafter really gives against plain steps; None with
    # a fixed cost model (tests), whose gating must not depend on the machine
    realized: RealizedRates | None
    confidence: ConfidenceCalibration  # how often the model drafter is right, by how sure
    setup: ModelDrafterSetup | None  # the model drafter (draft model, MTP head, ...)
    vocab_size: int  # the target's logits

    @property
    def drafter(self) -> ModelDrafter | None:
        """The model drafter for one sequence (None: prompt lookup alone, or nothing)."""
        return self.setup.single if self.setup else None


def build_speculation(
    registry: ModelRegistry, config: SpecConfig | None = None, cost: CostModel | None = None
) -> Speculation:
    """The setup for `registry`'s models: the model drafter its drafter kind makes, its
    costs measured now unless `cost` is given (then fixed, so gating is repeatable)."""
    config = config or SpecConfig()
    totals = SpecStats()
    vocab_size = registry.target.vocab_size
    setup = model_drafter(registry, vocab_size, config.prefill_step_size)
    method = setup.method if setup else None
    limits = DraftLimits(config, totals, method, learns_trust=cost is None)
    measured = cost or CostModel.measure(
        registry.target.model, setup.step_model if setup else None, limits.k_cap + 1
    )
    measured = measured.extended(limits.pld_cap + 1)  # then learned as verifies are served
    if setup is not None and setup.block:  # its draft cost is per proposal, not per token
        measured = replace(measured, block_draft=True)
    return Speculation(
        config=config,
        totals=totals,
        limits=limits,
        costs=OnlineCosts(measured, learn=cost is None),
        realized=RealizedRates.starting_from(measured.plain_seconds) if cost is None else None,
        confidence=ConfidenceCalibration(),
        setup=setup,
        vocab_size=vocab_size,
    )
