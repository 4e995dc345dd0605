"""Drafting with Gemma-4's `-assistant` drafter (`engines.drafting.gemma4_assistant_model`),
per sequence and for the rows of a batch.

The assistant keeps no cache of its own: each step reads the K/V the target's cache
already holds for two of its layers (the last non-shared full and sliding ones), with
its query at position T - 1 (T: the positions the target holds), and takes
[embedding(token), h] as input -- h first the target's final-norm state at its newest
held position, then the assistant's own returned state as the chain goes on. So a
request's drafting state is only that newest target state: its `MTPState` keeps it
(`newest`, from the states the engines hand over after every target forward), and the
target cache it reads is the request's own (`target_cache`, set by the engine before a
proposal) -- or, in the batch, the batch's rows. Nothing is written that a rollback
would have to undo.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engines.cache.ragged_cache import RaggedKVCache
from engines.drafting.draft import ASSISTANT, Draft, DraftStopRule
from engines.drafting.draft_model import chain_drafts
from engines.drafting.mtp import MTPState
from engines.request import SamplingParams
from engines.sample.sampling import RandomStream


def shared_kv(cache: list, layers: dict[str, int]) -> tuple[dict, dict]:
    """The K/V arrays of the target cache's `layers` ({layer type: index}) and each
    row's readable slots per layer type ((B,) array, or an int for one row)."""
    kv, slots = {}, {}
    for kind, index in layers.items():
        layer = cache[index]
        if isinstance(layer, RaggedKVCache):
            columns = layer.columns
            width = max(columns)
            kv[kind] = (layer.keys[..., :width, :], layer.values[..., :width, :])
            slots[kind] = columns[0] if len(columns) == 1 else mx.array(columns)
        else:  # one sequence's KVCache: its first `offset` slots
            kv[kind] = (layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :])
            slots[kind] = layer.offset
    return kv, slots


class AssistantDrafter:
    """Proposes up to k tokens, one assistant step each, for one sequence."""

    method = ASSISTANT
    fed_with_target = True  # fed the target's final-norm states (`engines.single.engine`)

    def __init__(self, loaded: Any, vocab_size: int) -> None:
        self.module = loaded.module
        self.layers = loaded.shared
        self.vocab_size = vocab_size

    def feed(self, state: MTPState) -> None:
        """Keep the newest pending target state; the others are never needed."""
        state.caught_up = state.pending
        if state.pending:
            state.newest = state.pending_hidden[-1][-1:]
            state.length += state.pending
            state.pending_hidden, state.pending_tokens, state.pending = [], [], 0

    def make_cache(self) -> None:
        return None

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
        """Up to k drafts after `context`; None when the state has not seen the target's
        newest held position (a restart) or the engine gave no target cache."""
        self.feed(state)
        held = len(context) - 1
        ready = state.newest is not None and state.start + state.length == held
        if k <= 0 or not ready or state.target_cache is None:
            return None
        kv, slots = shared_kv(state.target_cache, self.layers)
        hidden = state.newest[None]

        def step(token: mx.array) -> mx.array:
            nonlocal hidden
            logits, hidden = self.module.step(token, hidden, kv, held - 1, slots)
            return logits[0, -1:, : self.vocab_size].astype(mx.float32)

        first = step(mx.array([[context[-1]]], dtype=mx.int32))
        draft, _ = chain_drafts(
            self.method,
            first,
            lambda token: step(token[None]),
            k,
            params,
            rng,
            processors,
            context,
            position,
            stop,
        )
        return draft


class AssistantStepModel:
    """One assistant step shaped like a model, for the start-up cost measurement: its
    query over the K/V of one target position (a lower bound that served steps correct)."""

    def __init__(self, drafter: AssistantDrafter, target: Any, hidden_size: int) -> None:
        self.drafter = drafter
        self.target = target
        self.hidden_size = hidden_size

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        if not cache:  # the target's K/V of one position, made once
            held = make_prompt_cache(self.target)
            self.target(tokens[:1, :1], cache=held)
            cache.append(shared_kv(held, self.drafter.layers))
        kv, slots = cache[0]
        hidden = mx.zeros((1, 1, self.hidden_size))
        return self.drafter.module.step(tokens[:1, -1:], hidden, kv, 0, slots)[0]

    def make_cache(self) -> list:
        return []
