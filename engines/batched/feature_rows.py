"""A DFlash drafter drafting for every row of the batch in one forward.

As the MTP head does (`batched_mtp`, whose row bookkeeping this reuses): every target
forward of the batch runs through `HiddenTap`, here over the target's tapped layers
(`engines.model.taps`); each row's `MTPState` collects its positions' states; the
drafter's cache for all rows is one `RaggedKVCache` per drafter layer in the batch's
draft-cache slot, so rows join, leave, pause and migrate with it.

A drafting step is one ragged DFlash forward: each row's pending context (padded at
the end) and its block [newest token, mask x K], the context written to the row's
cache, the block never. Rows that do not draft this step still have their pending
context written (a block of one position, whose logits nobody reads). Each drafting
row then picks its tokens from the block's logits as a chained drafter would (argmax,
or a draw from its processed q with its own RNG), so verification is unchanged.

Invariant: drafter-cache row i holds exactly `rows[i].drafting.mtp.length` context positions
(a DFlash cache never holds a draft, so nothing is cut before a feed).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engines.batched.drafting import BatchRow, choose_tokens
from engines.batched.mtp import BatchedMTP, HiddenTap
from engines.cache.ragged_cache import RaggedKVCache
from engines.cache.rollback import trim_exact
from engines.drafting.draft import DRAFT
from engines.drafting.entries import drafter_entry
from engines.drafting.kinds import ModelDrafterSetup
from engines.drafting.mtp import MTPState
from engines.faults import check


class FeatureRows(BatchedMTP):
    """The batch's DFlash drafter (the calls `BatchedMTP` answers for the MTP head)."""

    def __init__(self, setup: ModelDrafterSetup, guarded: Any) -> None:
        drafter = setup.single
        self.method = drafter.method
        self.module = drafter.module
        self.mask_token = drafter.mask_token
        self.block_size = drafter.block_size
        self.feature_width = drafter.feature_width
        self.parts = setup.features
        self.target = HiddenTap(guarded, self.parts)
        self.vocab_size = setup.vocab_size
        self.entry_ahead = drafter.entry_ahead

    def join(self, row: BatchRow, draft=None, mtp: MTPState | None = None) -> list:
        """The row's drafter cache as it joins (a prefix-cache entry's context comes as
        `mtp`: `engines.state.resume_drafter`); its state kept with the row (none for a
        row that may not draft with it)."""
        row.drafting.mtp = (mtp or MTPState()) if DRAFT in row.drafting.gates else None
        if row.drafting.mtp is None or row.drafting.mtp.cache is None:
            return self.module.make_cache()
        cache, row.drafting.mtp.cache = row.drafting.mtp.cache, None  # the batch holds it now
        return cache

    def leave(self, cache: list[RaggedKVCache], rows: list[BatchRow], index: int):
        return leave_with_entry(self, cache, rows, index)

    def copy(self, cache: list[RaggedKVCache], rows: list[BatchRow], index: int):
        """Row `index`'s context K/V for a prefix-cache entry (copies); the row goes on."""
        state = rows[index].drafting.mtp
        layers = [layer.extract(index) for layer in cache]
        return drafter_entry(state, rows[index].tokens, layers, self.entry_ahead)

    def check(self, cache: list[RaggedKVCache], rows: list[BatchRow]) -> None:
        assert all(
            row.drafting.mtp is None or cache[0].lengths[i] == row.drafting.mtp.length
            for i, row in enumerate(rows)
        ), "drafter row out of step"

    def feed(self, cache: list[RaggedKVCache], rows: list[BatchRow]) -> None:
        """Write every row's pending context (a block of one mask position each)."""
        if any(row.drafting.mtp is not None and row.drafting.mtp.pending for row in rows):
            self._forward(cache, rows, [[] for _ in rows])

    def _forward(
        self, cache: list[RaggedKVCache], rows: list[BatchRow], blocks: list[list[int]]
    ) -> mx.array:
        """One ragged drafter forward: row i's pending context, then `blocks[i]`
        (padded with mask tokens to the widest). Logits (B, width - 1, V)."""
        states = [row.drafting.mtp for row in rows]
        counts = [state.pending if state else 0 for state in states]
        width = max(2 if any(blocks) else 1, *(len(block) for block in blocks))
        tokens = [block + [self.mask_token] * (width - len(block)) for block in blocks]
        like = next((s.pending_hidden[0] for s, n in zip(states, counts, strict=True) if n), None)
        features = mx.zeros((len(rows), 0, self.feature_width))
        if like is not None:
            wide = max(counts)
            padded = []
            for state, count in zip(states, counts, strict=True):
                h = mx.concatenate(state.pending_hidden) if count else mx.zeros((0, like.shape[-1]))
                padded.append(mx.pad(h.astype(like.dtype), [(0, wide - count), (0, 0)]))
            features = mx.stack(padded)
        logits = self.module.draft_logits(features, counts, mx.array(tokens, dtype=mx.int32), cache)
        for state, count in zip(states, counts, strict=True):
            if count:
                state.length += count
                state.pending_hidden, state.pending_tokens, state.pending = [], [], 0
        return logits

    def draft(
        self, cache: list[RaggedKVCache], rows: list[BatchRow], target: list | None = None
    ) -> tuple[int, bool]:
        """`row.draft_length` drafts for every row drafting with DFlash whose state has
        seen its newest token but one (others draft nothing), in one forward."""
        steady = all(row.drafting.mtp is None or row.drafting.mtp.pending <= 2 for row in rows)
        ready = []
        for row in rows:
            state = row.drafting.mtp
            ok = (
                row.method == self.method
                and state is not None
                and state.start + state.length + state.pending == len(row.tokens) - 1
            )
            if row.method == self.method and not ok:
                row.method, row.drafts, row.draft_length = None, [], 0
            ready.append(ok)
        lengths = [
            min(row.draft_length, self.block_size - 1) if ok else 0
            for row, ok in zip(rows, ready, strict=True)
        ]
        if not any(lengths):
            self.feed(cache, rows)
            check([rows[i] for i in self.drafting_rows(rows)], "draft")
            return 0, steady
        blocks = [
            [row.tokens[-1]] + [self.mask_token] * n if n else []
            for row, n in zip(rows, lengths, strict=True)
        ]
        logits = self._forward(cache, rows, blocks)[..., : self.vocab_size].astype(mx.float32)
        proposals: list[list[int]] = [[] for _ in rows]
        probs: list[list[mx.array]] = [[] for _ in rows]
        for step in range(max(lengths)):
            drafting = [step < n for n in lengths]
            choose_tokens(rows, logits[:, step, :], drafting, proposals, probs)
        for row, n, proposal, q in zip(rows, lengths, proposals, probs, strict=True):
            if n:
                row.drafts, row.draft_length = proposal, n
                row.probs = mx.stack(q) if q else None
        check([rows[i] for i in self.drafting_rows(rows)], "draft")
        return 1, steady

    def recover(self, cache: list[RaggedKVCache], rows: list[BatchRow], failed: list[int]) -> None:
        """After a draft that raised: every row's cache back to its true context (a
        forward that failed may have written past it), the failed rows' states gone."""
        for layer in cache:
            layer.set_lengths(
                [
                    0 if row.drafting.mtp is None else min(row.drafting.mtp.length, n)
                    for row, n in zip(rows, layer.lengths, strict=True)
                ]
            )
        for i in failed:
            rows[i].drafting.mtp = None


class Eagle3Rows(BatchedMTP):
    """An EAGLE-3 speculator's rows: chained as the MTP head's are (its `pairs`,
    `chained`, `batch_logits`), its one-layer cache kept ragged when a row leaves, and
    its pairs kept in prefix-cache entries (`engines.drafting.entries`)."""

    def copy(self, cache: list[RaggedKVCache], rows: list[BatchRow], index: int):
        """Row `index`'s true pairs (its chained drafts cut) for a prefix-cache entry
        (copies); the row goes on."""
        state = rows[index].drafting.mtp
        if state is None:
            return None
        head = cache[0].extract(index)
        trim_exact([head], head.offset - state.length)
        return drafter_entry(state, rows[index].tokens, [head], self.entry_ahead)

    def leave(self, cache: list[RaggedKVCache], rows: list[BatchRow], index: int):
        return leave_with_entry(self, cache, rows, index)


def leave_with_entry(drafter: BatchedMTP, cache: list[RaggedKVCache], rows, index: int):
    """A feature drafter's row leaving: (what a prefix-cache entry keeps of it, the row's
    state with its own one-row cache of its true positions again)."""
    state = rows[index].drafting.mtp
    if state is None:
        return None, None
    entry = drafter.copy(cache, rows, index)
    own = [layer.take([index]) for layer in cache]
    for layer in own:
        layer.set_lengths([state.length])
    state.cache, state.speculative = own, 0
    return entry, state
