"""Drafting with the model's own MTP head (`engines.model.mtp`), per sequence.

The head's KV cache entry i is built from the pair (target hidden state at
position i, token i+1). The engine hands over the hidden states of every target
forward (`observe`): prefill chunks, plain steps, the accepted part of a verify.
They wait in `pending` (lazy arrays, nothing computed for them) until the next
proposal feeds them all in one head forward, so a closed gate costs only a list
append per step. A proposal then chains: the head's output state and the token it
drafted are the next pair, up to k tokens; those chained entries are speculative
and are removed before the next feed.

What the head holds only decides how good its drafts are, never which tokens are
committed (every draft is verified), so positions it never saw (a prompt served
from the prefix cache, steps taken while batched) just start a fresh head cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from engines.cache.rollback import trim_exact
from engines.drafting.draft import MTP, Draft, DraftStopRule
from engines.drafting.draft_model import chain_drafts
from engines.model.mtp import MTPHead, TargetParts
from engines.request import SamplingParams
from engines.sample.sampling import RandomStream

MAX_PENDING = 4096  # hidden states kept for a closed gate; older ones are dropped


@dataclass
class MTPState:
    """One sequence's MTP head cache and the target hidden states not yet fed to it.

    Invariant: the cache holds `length` pairs for target positions start..start+length-1,
    then `speculative` chained entries; `pending_*` continue at start + length."""

    cache: list | None = None
    start: int = 0
    length: int = 0
    speculative: int = 0
    pending_hidden: list[mx.array] = field(default_factory=list)  # each (n, D)
    pending_tokens: list[mx.array] = field(default_factory=list)  # each (n,) int
    pending: int = 0
    newest: mx.array | None = None  # the head's output at its newest true entry (1, 1, D)
    caught_up: int = 0  # pairs the last proposal fed before drafting
    # the request's own target cache, which Gemma-4's assistant reads (set by the
    # single-stream engine before a proposal; unused by the other drafters)
    target_cache: list | None = None
    catch_up_seconds: float = 0.0  # never separated: catching up is one small forward

    @property
    def next_position(self) -> int:
        return self.start + self.length + self.pending

    def observe(self, position: int, hidden: mx.array, tokens: mx.array) -> None:
        """Target hidden states (n, D) at positions position.., and the n tokens that
        follow them. A gap (positions the head never saw) restarts the head there."""
        if position != self.next_position:
            self.restart(position)
        if self.pending + hidden.shape[0] > MAX_PENDING:
            self.restart(position)
        self.pending_hidden.append(hidden)
        self.pending_tokens.append(tokens)
        self.pending += hidden.shape[0]

    def restart(self, position: int) -> None:
        self.cache, self.start, self.length, self.speculative = None, position, 0, 0
        self.newest = None
        self.pending_hidden, self.pending_tokens, self.pending = [], [], 0


class MTPDrafter:
    """Proposes up to k tokens with the head, chained from the newest committed pair."""

    method = MTP
    fed_with_target = True  # fed the target's hidden states (`engines.single.engine`)

    def __init__(self, head: MTPHead, target: TargetParts, vocab_size: int) -> None:
        self.head = head
        self.target = target
        self.vocab_size = vocab_size

    def feed(self, state: MTPState) -> mx.array | None:
        """Feed every pending pair; the head's output at the newest entry (lazy, shape
        (1, 1, D)), or None when the head holds nothing."""
        if state.cache is None:
            state.cache = self.make_cache()
        if state.speculative:
            trim_exact(state.cache, state.speculative)
            state.speculative = 0
        state.caught_up = state.pending
        if not state.pending:
            return state.newest
        hidden = mx.concatenate(state.pending_hidden, axis=0)[None]
        tokens = mx.concatenate(state.pending_tokens).astype(mx.int32)[None]
        out = self.pairs(tokens, hidden, state.cache)
        state.length += state.pending
        state.pending_hidden, state.pending_tokens, state.pending = [], [], 0
        state.newest = out[:, -1:, :]
        return state.newest

    def propose(
        self,
        state: MTPState,
        context: list[int],
        k: int,
        params: SamplingParams,
        rng: RandomStream,
        processors: list | None = None,
        position: int = 0,
        stop: DraftStopRule | None = None,
    ) -> Draft | None:
        """Up to k drafts after `context` (whose last token's pair must be the newest
        fed or pending); the same contract as `DraftModelDrafter.propose`."""
        if k <= 0:
            return None
        out = self.feed(state)
        if out is None or state.start + state.length != len(context) - 1:
            return None  # the head has not seen the newest token: no draft this step

        def advance(token: mx.array) -> mx.array:
            """The next pair: the head's own output state and the token it drafted."""
            nonlocal out
            out = self.chained(token[None], out, state.cache)
            state.speculative += 1
            return self._logits(out)

        draft, _ = chain_drafts(
            self.method,
            self._logits(out),
            advance,
            k,
            params,
            rng,
            processors,
            context,
            position,
            stop,
        )
        return draft

    # ---- what a head of this kind computes (EAGLE-3 answers the same calls) ----------

    def pairs(self, tokens: mx.array, hidden: mx.array, cache: list) -> mx.array:
        """The head's output states for true pairs: target states `hidden` (1, n, D),
        each with the token after it (`tokens`, (1, n)), appended to `cache`."""
        return self.head(self.target.embed_tokens(tokens), hidden, cache[0])

    def chained(self, tokens: mx.array, out: mx.array, cache: list) -> mx.array:
        """The next chained entry: the head's own output state with the token it drafted."""
        return self.head(self.target.embed_tokens(tokens), out, cache[0])

    def make_cache(self) -> list:
        return self.head.make_cache()

    def batch_logits(self, out: mx.array) -> mx.array:
        """Logits over the target's vocabulary (B, n, V) of output states (B, n, D)."""
        return self.target.logits(out)[..., : self.vocab_size]

    def _logits(self, out: mx.array) -> mx.array:
        """The newest output state's logits, (1, V) float32."""
        return self.batch_logits(out)[0, -1:].astype(mx.float32)
