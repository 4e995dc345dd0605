"""The MTP head drafting for every row of the batch at once.

Each row keeps its own `MTPState` (`engines.drafting.mtp`: which target positions its
head entries cover, the pairs not fed yet), as a single-stream request does. The
head's KV cache for all rows is one `RaggedKVCache` layer kept in the batch's
draft-cache slot -- a draft model and the head never draft together -- so rows join,
leave, pause and migrate with their head entries as they do with a draft model's.

Every target forward of the batch runs through `HiddenTap`, which keeps its hidden
states; the engine hands each row its (hidden state, following token) pairs
(`MTPState.observe`, lazy arrays). A drafting step first feeds every row's pending
pairs in one ragged head forward, then chains the head over the rows that draft, one
forward per drafted position, exactly as a draft model chains (`chain_rows`).

Invariant: head-cache row i holds `rows[i].drafting.mtp.length` true entries first; entries
after them are chained drafts (or padding), cut before the next feed. A restart (a
stretch the head never saw) sets the length to 0.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from engines.batched.drafting import BatchRow, chain_rows
from engines.cache.ragged_cache import RaggedKVCache
from engines.cache.rollback import trim_exact
from engines.drafting.draft import DRAFT
from engines.drafting.mtp import MTPDrafter, MTPState
from engines.faults import check


class HiddenTap:
    """The target as the batch calls it (`model(inputs, cache=cache)` -> logits), run
    as backbone then LM head -- the same ops, the same logits -- keeping the newest
    forward's hidden states for the MTP head."""

    def __init__(self, model: Any, parts: Any) -> None:
        self.model = model  # the engine's guarded model: ownership is checked first
        self.parts = parts
        self.hidden: mx.array | None = None  # (B, T, D) of the newest forward

    def __call__(
        self, inputs: mx.array, cache: list, input_embeddings: mx.array | None = None
    ) -> mx.array:
        self.model.guard(inputs)
        logits, self.hidden = self.parts.forward(inputs, cache, input_embeddings)
        return logits

    def make_cache(self) -> list:
        """The target's own cache, for what builds one from the engine's model (prompt
        scoring started while batched)."""
        return make_prompt_cache(self.model)


class _HeadSteps:
    """One chained head step over the batch, shaped like a model for `chain_rows`:
    the drafted tokens with the head's own previous outputs are the next pairs."""

    def __init__(self, drafter: MTPDrafter, out: mx.array) -> None:
        self.drafter, self.out = drafter, out

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        self.out = self.drafter.chained(tokens, self.out, cache)
        return self.drafter.batch_logits(self.out)


class BatchedMTP:
    """The MTP head -- or an EAGLE-3 speculator, which chains the same way on the
    target's tapped layers -- as the batch's model drafter (the calls `DraftModelRows`
    answers for a draft model), with the target it needs hidden states from
    (`target`). `drafter` is the single-stream drafter: its `pairs`, `chained` and
    `batch_logits` are what a head of its kind computes."""

    fed_with_target = True  # its cache is fed with each target forward's hidden states

    def __init__(self, drafter: MTPDrafter, parts: Any, guarded: Any, vocab_size: int) -> None:
        self.drafter = drafter
        self.method = drafter.method
        self.parts = parts
        self.target = HiddenTap(guarded, parts)  # the batch's target forwards
        self.vocab_size = vocab_size
        # what its prefix-cache entries keep (EAGLE-3: `engines.drafting.entries`)
        self.entry_ahead = getattr(drafter, "entry_ahead", None)

    # ---- rows joining and leaving -------------------------------------------------

    def join(self, row: BatchRow, draft=None, mtp: MTPState | None = None) -> list[KVCache]:
        """The row's head cache as it joins (its chained drafts cut), its state kept
        with the row; a row that may not draft with the head gets no state."""
        row.drafting.mtp = (mtp or MTPState()) if DRAFT in row.drafting.gates else None
        if row.drafting.mtp is None or row.drafting.mtp.cache is None:  # no entries yet (length 0)
            return self.drafter.make_cache()
        cache, row.drafting.mtp.cache = row.drafting.mtp.cache, None  # the batch holds it now
        trim_exact(cache, row.drafting.mtp.speculative)
        row.drafting.mtp.speculative = 0
        return cache

    def copy(self, cache: list[RaggedKVCache], rows: list[BatchRow], index: int) -> None:
        """No draft state: a prefix-cache entry keeps no MTP head cache (a request
        started from one feeds the head from its own forwards)."""
        return None

    def leave(self, cache: list[RaggedKVCache], rows: list[BatchRow], index: int):
        """(no draft state, the row's MTP state with its own head cache again)."""
        state = rows[index].drafting.mtp
        if state is None:
            return None, None
        head = cache[0].extract(index)
        trim_exact([head], head.offset - state.length)
        state.cache, state.speculative = [head], 0
        return None, state

    def check(self, cache: list[RaggedKVCache], rows: list[BatchRow]) -> None:
        assert all(
            row.drafting.mtp is None or cache[0].lengths[i] >= row.drafting.mtp.length
            for i, row in enumerate(rows)
        ), "head row out of step"

    # ---- pairs from the batch's target forwards ---------------------------------

    def observe(
        self,
        rows: list[BatchRow],
        positions: list[int],
        following: list[list[int] | mx.array],
        index: mx.array | None = None,
    ) -> None:
        """Row i's part of the newest target forward (its row `index[i]`, if given)
        started at `positions[i]`; the tokens after those positions are `following[i]`
        (as many pairs as it has tokens)."""
        hidden = self.target.hidden if index is None else self.target.hidden[index]
        for i, (row, tokens) in enumerate(zip(rows, following, strict=True)):
            count = len(tokens) if isinstance(tokens, list) else tokens.size
            if row.drafting.mtp is None or not count:
                continue
            tokens = mx.array(tokens) if isinstance(tokens, list) else tokens
            row.drafting.mtp.observe(positions[i], hidden[i, :count], tokens)

    def prefill(self, rows: list[BatchRow], cache: list, before: list[int], after: list[int]):
        """The head sees the prompt chunk just fed, as it does alone (fed now: a long
        prompt's hidden states are large)."""
        fed = [r.tokens[b + 1 : a + 1] for r, b, a in zip(rows, before, after, strict=True)]
        self.observe(rows, before, fed)
        self.feed(cache, rows)

    def feed(self, cache: list[RaggedKVCache], rows: list[BatchRow]) -> None:
        """Cut every row's chained entries, then feed each its pending pairs in one
        ragged head forward (rows with none pad along and keep their length)."""
        layer = cache[0]
        states = [row.drafting.mtp for row in rows]
        layer.set_lengths([state.length if state else 0 for state in states])
        counts = [state.pending if state else 0 for state in states]
        if not any(counts):
            return
        width = max(counts)
        hidden, tokens = [], []
        like = next(s.pending_hidden[0] for s, n in zip(states, counts, strict=True) if n)
        for state, count in zip(states, counts, strict=True):
            h = mx.concatenate(state.pending_hidden) if count else mx.zeros((0, like.shape[-1]))
            t = mx.concatenate(state.pending_tokens) if count else mx.zeros((0,), mx.int32)
            hidden.append(mx.pad(h.astype(like.dtype), [(0, width - count), (0, 0)]))
            tokens.append(mx.pad(t.astype(mx.int32), [(0, width - count)]))
        out = self.drafter.pairs(mx.stack(tokens), mx.stack(hidden), cache)
        layer.set_lengths(  # padding cut: each row holds its true entries
            [0 if s is None else s.length + n for s, n in zip(states, counts, strict=True)]
        )
        for i, (state, count) in enumerate(zip(states, counts, strict=True)):
            if count:
                state.length += count
                state.newest = out[i : i + 1, count - 1 : count]
                state.pending_hidden, state.pending_tokens, state.pending = [], [], 0

    # ---- drafting -------------------------------------------------------------------

    def draft(
        self, cache: list[RaggedKVCache], rows: list[BatchRow], target: list | None = None
    ) -> tuple[int, bool]:
        """`row.draft_length` drafts for every row whose method is MTP and whose head
        has seen its newest token (the others draft nothing this step). Returns the
        head forwards the chain ran, and whether no row had a backlog to catch up."""
        steady = all(row.drafting.mtp is None or row.drafting.mtp.pending <= 2 for row in rows)
        self.feed(cache, rows)
        ready = [
            row.method == self.method
            and row.drafting.mtp is not None
            and row.drafting.mtp.newest is not None
            and row.drafting.mtp.start + row.drafting.mtp.length == len(row.tokens) - 1
            for row in rows
        ]
        for row, ok in zip(rows, ready, strict=True):
            if row.method == self.method and not ok:
                row.method, row.drafts, row.draft_length = None, [], 0
        lengths = [row.draft_length if ok else 0 for row, ok in zip(rows, ready, strict=True)]
        if any(lengths):
            newest = [
                row.drafting.mtp.newest if ok else None for row, ok in zip(rows, ready, strict=True)
            ]
            like = next(n for n in newest if n is not None)
            out = mx.concatenate([like * 0 if n is None else n for n in newest])
            logits = self.drafter.batch_logits(out)[:, 0]
            chain_rows(_HeadSteps(self.drafter, out), cache, rows, logits, lengths)
        check([rows[i] for i in self.drafting_rows(rows)], "draft")
        return max(lengths), steady

    def drafting_rows(self, rows: list[BatchRow]) -> list[int]:
        """The rows a draft feeds (those with a head state)."""
        return [i for i, row in enumerate(rows) if row.drafting.mtp is not None]

    def recover(self, cache: list[RaggedKVCache], rows: list[BatchRow], failed: list[int]) -> None:
        """After a draft that raised: the `failed` rows lose their head state (the head
        drafts for them no more). Every other row's is consistent as it is: a head
        forward that failed consumed none of its pending pairs, and the next feed cuts
        whatever the head cache holds past its true entries."""
        for i in failed:
            rows[i].drafting.mtp = None
