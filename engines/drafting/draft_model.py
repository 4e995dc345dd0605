"""The draft model: a small model drafting on each sequence's own `DraftState`.

`DraftModelDrafter` keeps the state in step with the committed tokens (it prefills only
what it has not seen, after rolling back what was rejected) and samples from its own
processed distribution q. The state lives with the request (in `SequenceState`), so one
request's tokens are never proposed to another.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engines.cache.rollback import CacheSnapshot, can_trim, roll_back, take_snapshot, trim_exact
from engines.drafting.draft import DRAFT, Draft, DraftStopRule
from engines.drafting.draft_vocab import OwnTokens, bind_own
from engines.request import SamplingParams, common_prefix
from engines.sample.sampling import RandomStream, filter_logprobs


@dataclass
class DraftState:
    """One sequence's draft-model KV cache and the tokens it holds (`fed`).

    It lives with the request (in `SequenceState`), so it migrates between engines
    and is never shared between requests."""

    cache: list | None = None
    fed: list[int] = field(default_factory=list)
    # A cache that cannot trim (recurrent, windowed) rolls back to this: taken when it
    # held exactly fed[:snapshot_length], before the last proposal's drafts were fed.
    snapshot: CacheSnapshot | None = None
    snapshot_length: int = 0
    caught_up: int = 0  # tokens the last proposal had to feed before drafting
    catch_up_seconds: float = 0.0  # what feeding them took, when more than two
    # its tokens a draft with a reduced vocabulary also scores (`engines.drafting.draft_vocab`)
    own: OwnTokens = field(default_factory=OwnTokens)


class DraftModelDrafter:
    """A small model that drafts autoregressively, on each sequence's own `DraftState`.

    Invariant: `state.fed` lists exactly the tokens in `state.cache`. Before drafting,
    the cache is rolled back to the longest prefix shared with the committed context
    and the rest of the context is fed, so it never re-prefills what it has seen.
    """

    method = DRAFT

    def __init__(self, model: Any, vocab_size: int, prefill_step_size: int = 2048) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.prefill_step_size = prefill_step_size

    def propose(
        self,
        state: DraftState,
        context: list[int],
        k: int,
        params: SamplingParams,
        rng: RandomStream,
        processors: list | None = None,
        position: int = 0,
        stop: DraftStopRule | None = None,
    ) -> Draft | None:
        """Up to k draft tokens after `context`; `position` is the output position of
        the first (a seeded request's draws are keyed by it). With `stop`, each token's
        confidence (the draft's probability for it) is read as it is drafted, drafting
        ends where `stop` says one more would not pay, and the proposal is cut to its
        best length (at least one token).

        The k draft steps are queued as one lazy chain -- each token fed to the next
        forward as an array and evaluated asynchronously, as mlx_lm's speculative loop
        does -- and read once at the end: one wait per proposal instead of one per
        token (on a small draft model the waits, not the compute, were most of a draft
        step). Processors see the history as a lazy array too; one that needs its
        values (a grammar) reads them itself."""
        if k <= 0:
            return None
        model = bind_own(self.model, [state.own], [context])
        logits = self._catch_up(model, state, context)[None]

        def advance(token: mx.array) -> mx.array:
            out = model(token[None], cache=state.cache)[0, -1:, : self.vocab_size]
            return out.astype(mx.float32)

        draft, drafted = chain_drafts(
            DRAFT, logits, advance, k, params, rng, processors, context, position, stop
        )
        state.fed.extend(drafted[:-1])  # every draft token but the last was fed
        return draft

    def _catch_up(self, model: Any, state: DraftState, context: list[int]) -> mx.array:
        """Roll back to the shared prefix (keeping one token to feed), feed the rest."""
        if state.cache is None:
            state.cache = make_prompt_cache(self.model)
            state.fed = []
        shared = shared_prefix(state.fed, context)
        if shared < len(state.fed):
            if can_trim(state.cache, len(state.fed) - shared):
                trim_exact(state.cache, len(state.fed) - shared)
            elif state.snapshot is not None and state.snapshot_length <= shared:
                roll_back(state.cache, len(state.fed) - state.snapshot_length, state.snapshot)
                shared = state.snapshot_length
            else:  # nothing to roll back to: start over
                state.cache, shared = make_prompt_cache(self.model), 0
            del state.fed[shared:]
            state.snapshot = None
        pending = context[shared:]
        state.caught_up = len(pending)
        started = time.perf_counter()
        while len(pending) > self.prefill_step_size:
            self._forward(model, state, pending[: self.prefill_step_size])
            pending = pending[self.prefill_step_size :]
        logits = self._forward(model, state, pending)
        state.snapshot, state.snapshot_length = take_snapshot(state.cache), len(state.fed)
        if state.caught_up > 2:  # a catch-up after plain steps or a prompt: timed alone,
            mx.eval(logits)  # so what drafting steps cost can leave it out
        state.catch_up_seconds = time.perf_counter() - started if state.caught_up > 2 else 0.0
        return logits

    def _forward(self, model: Any, state: DraftState, tokens: list[int]) -> mx.array:
        logits = model(mx.array(tokens)[None], cache=state.cache)[0, -1, : self.vocab_size]
        state.fed.extend(tokens)
        return logits.astype(mx.float32)


def chain_drafts(
    method: str,
    logits: mx.array,
    advance: Callable[[mx.array], mx.array],
    k: int,
    params: SamplingParams,
    rng: RandomStream,
    processors: list | None,
    context: list[int],
    position: int,
    stop: DraftStopRule | None,
) -> tuple[Draft, list[int]]:
    """Up to k tokens drafted one after another from (1, V) `logits`, `advance(token)`
    giving the logits after each; returns the draft (cut to `stop`'s best length, at
    least one token) and every token drafted. Token i is for output `position + i`
    (a seeded request's draws are keyed by it); processors see the history. The
    steps are one lazy chain, evaluated asynchronously and read once at the end (one
    wait per proposal, not per token), except each confidence `stop` reads."""
    history = mx.array(context, dtype=mx.int32) if processors else None
    tokens, probs = [], []
    for i in range(k):
        token, q, confidence = draft_token(logits, params, rng, processors, history, position + i)
        if q is not None:
            probs.append(q[0])
        mx.async_eval(token, confidence)
        tokens.append(token)
        if history is not None:
            history = mx.concatenate([history, token.astype(mx.int32)])
        if stop is not None and not stop.add(confidence.item()):
            break
        if i + 1 < k:
            logits = advance(token)
    drafted = mx.concatenate(tokens).tolist()
    if stop is None:
        return Draft(method, drafted, mx.stack(probs) if probs else None), drafted
    keep = stop.best_length()
    q = mx.stack(probs[:keep]) if probs else None
    return Draft(method, drafted[:keep], q, confidences=stop.confidences[:keep]), drafted


def shared_prefix(fed: list[int], context: list[int]) -> int:
    """Length of the common prefix, leaving at least the newest context token unfed."""
    return max(0, min(common_prefix(fed, context), len(context) - 1))


def draft_token(
    logits: mx.array,
    params: SamplingParams,
    rng: RandomStream,
    processors: list | None,
    history: mx.array | None,
    position: int,
) -> tuple[mx.array, mx.array | None, mx.array]:
    """The draft's next token (for output `position`; lazy, shape (1,)) from (1, V)
    logits after the request's processors (which see `history`): argmax when greedy,
    else a sample from q (returned, (1, V) float32). A seeded request samples with the
    key the target will use at that position, so draft and target draws are coupled.
    Last, the draft's probability for the token (lazy, shape (1,)): how sure it is."""
    for processor in processors or ():
        logits = processor(history, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if params.greedy:
        return mx.argmax(logprobs, axis=-1), None, mx.exp(mx.max(logprobs, axis=-1))
    q = mx.softmax(filter_logprobs(params, logprobs) * (1.0 / params.temperature), axis=-1)
    token = mx.random.categorical(mx.log(q), key=rng.draw_key(position))
    return token, q, mx.take_along_axis(q, token[:, None], axis=-1)[:, 0]


def choose_draft_token(
    logits: mx.array,
    params: SamplingParams,
    rng: RandomStream,
    processors: list | None,
    history: list[int],
    position: int,
) -> tuple[int, mx.array | None]:
    """`draft_token`, read: the token as an int."""
    tokens = mx.array(history, dtype=mx.int32) if processors else None
    token, q, _ = draft_token(logits, params, rng, processors, tokens, position)
    return int(token.item()), q
