"""What speculation is configured with: the server's drafting settings, shared by the
single-stream and the batched speculative engines and by the gates that bound a draft
(`engines.gating.draft_limits`). A leaf: it imports nothing of the engines, so the
gating package and the per-request state (`engines.state`) both read it one way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecConfig:
    # The most draft-model tokens in a proposal: one request's stop earlier where the
    # draft is unsure (`engines.gating.draft_confidence`), a batched row's at the batch's K.
    num_draft_tokens: int = 8  # the server default (for_server with no --num-draft-tokens)
    max_draft_tokens: int = 8  # per-request overrides are clamped to this
    enable_pld: bool = True
    # The longest prompt lookup draft of a request served alone: a copied stretch pays
    # with long drafts (verifying 17 tokens cost 1.9 plain steps for Qwen2.5-Coder-1.5B
    # on a CPU, about one on a GPU). In the batch, lookup drafts stay within
    # max_draft_tokens: there one row's long draft pads every row's verify.
    pld_max_draft_tokens: int = 16
    pld_max_ngram: int = 3
    pld_preferred_match: int = 2  # with both drafters, PLD drafts when its match is this long
    pld_probe_match: int = 2  # a closed PLD gate probes only on a match at least this long
    prompt_gate_threshold: float = 0.05  # prompt repetition score below which PLD starts closed
    prefill_step_size: int = 2048

    @property
    def draft_cap(self) -> int:
        """The longest draft of the model drafter (a request may ask for less): the
        server's --num-draft-tokens where it asks for more than `max_draft_tokens`."""
        return max(self.num_draft_tokens, self.max_draft_tokens)

    @classmethod
    def for_server(cls, num_draft_tokens: int | None, **settings) -> SpecConfig:
        """Settings from a server's --num-draft-tokens: a number is the user's cap on
        every draft-model proposal; None keeps the default, drafts running to
        `max_draft_tokens` (8), one request's stopping where the draft is unsure, a
        batched row's at the K the batch's goodput chooses. A fixed default of 4 held a
        matched draft to half its yield: at c=2 the batch then served two users more
        slowly than one-at-a-time drafting to 8."""
        k = cls.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        return cls(num_draft_tokens=k, **settings)
