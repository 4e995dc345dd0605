"""What each request may draft: its longest draft per method and the gates it starts
with. One object, shared by the single-stream and the batched engine, so a request
migrating between them keeps the same limits and its gates are opened the same way."""

from __future__ import annotations

from dataclasses import dataclass

from engines.drafting.draft import DRAFT, LOOKUPS, PLD, SUFFIX
from engines.gating.gates import MethodGate, prompt_repetition_score
from engines.sequence import Sequence
from engines.spec_config import SpecConfig
from engines.telemetry import SpecStats

# A model drafter whose first token was accepted in fewer than this share of its drafts
# over the server's life (once it drafted DISTRUSTED_SAMPLE times) does not pay at any
# draft length: 1 + 0.1 tokens a verify. New requests then start its gate closed, with a
# probe after DISTRUSTED_COOLDOWN plain tokens, instead of each paying its own failed
# drafts and early probes to find that out again: a random-weight DFlash drafter cost
# single-stream decode 5-6% (its gates opened on every request of 64 tokens).
DISTRUSTED_ACCEPTANCE = 0.1
DISTRUSTED_SAMPLE = 32
DISTRUSTED_COOLDOWN = 64


@dataclass
class DraftLimits:
    config: SpecConfig
    totals: SpecStats  # lifetime counters: a prompt that closes lookup's gate is counted
    # the model drafter's method (its drafts are counted under it in `totals`): a draft
    # model, the target's MTP head or a feature drafter; None when there is none
    drafter_method: str | None = None
    # whether the server's life may close a drafter's gates (`drafter_distrusted`): off
    # where costs are fixed (tests, benchmarks), so gating repeats whatever ran before
    learns_trust: bool = True

    @property
    def has_model_drafter(self) -> bool:
        return self.drafter_method is not None

    @property
    def k_cap(self) -> int:
        """The longest draft of the model drafter (a request may ask for less)."""
        return self.config.draft_cap

    @property
    def pld_cap(self) -> int:
        """Prompt lookup's own cap: its drafts cost nothing to make, so a long copy of
        the prompt may draft beyond the model drafter's cap."""
        return max(self.k_cap, self.config.pld_max_draft_tokens) if self.k_cap else 0

    def request_k(self, seq: Sequence, method: str = DRAFT) -> int:
        """The longest draft `method` may propose for this request: the request's own
        num_draft_tokens if it set one; else the server's for the draft model, and
        lookup's own cap for prompt lookup, whose drafts cost nothing to make (a long
        copy of the prompt pays with long drafts; the gate still picks k by what
        verifies cost)."""
        k = seq.request.speculation.num_draft_tokens
        if k is not None:
            return max(0, min(k, self.k_cap))
        if method in LOOKUPS and self.config.num_draft_tokens > 0:
            return self.pld_cap
        return self.config.num_draft_tokens

    def initial_gates(self, seq: Sequence) -> dict[str, MethodGate]:
        """A gate per drafting method the request may use. Lookup's starts closed on a
        prompt with too little repetition to copy from (it reopens on evidence); the
        suffix drafter's starts open (it drafts only on a match in the key's earlier
        requests, and rests while there is none)."""
        overrides = seq.request.speculation
        gates = {}
        if self.request_k(seq) == 0:
            return gates
        pld_on = self.config.enable_pld if overrides.enable_pld is None else overrides.enable_pld
        if pld_on:
            gate = MethodGate(PLD, alpha=0.5)
            score = prompt_repetition_score(seq.request.prompt_tokens)
            if score < self.config.prompt_gate_threshold:
                gate.close()
                seq.spec.trip("prompt")
                self.totals.trip("prompt")
            gates[PLD] = gate
        # its key's earlier requests (`engines.drafting.suffix`); a request's
        # enable_pld=false turns off both lookup drafters (they copy tokens from text)
        if seq.suffix is not None and overrides.enable_pld is not False:
            gates[SUFFIX] = MethodGate(SUFFIX, alpha=0.5)
        if self.has_model_drafter and overrides.enable_draft is not False:
            gate = gates[DRAFT] = MethodGate(DRAFT, alpha=0.6)
            if self.drafter_distrusted():
                gate.open, gate.cooldown = False, DISTRUSTED_COOLDOWN
                gate.backoff = DISTRUSTED_COOLDOWN  # a failed probe waits twice that
        return gates

    def drafter_distrusted(self) -> bool:
        """The model drafter's first token was accepted in fewer than
        DISTRUSTED_ACCEPTANCE of its drafts over the server's life (read on the engine
        thread, which writes `totals`)."""
        stats = self.totals.by_method.get(self.drafter_method)
        if not self.learns_trust or stats is None or stats.drafts < DISTRUSTED_SAMPLE:
            return False
        return stats.first_accepted < DISTRUSTED_ACCEPTANCE * stats.drafts
