"""Gemma-4's assistant drafting for every row of the batch at once.

The assistant reads the batch's own target cache (`engines.drafting.assistant`): each
drafting step is one assistant forward over all rows, each row's query at its own
position (its target row's length - 1) over the K/V its target row holds in the two
shared layers, padded rows masked by their own slot counts. Its only per-row state is
the newest target final-norm state (the row's `MTPState.newest`), kept as the MTP head's
pending states are (`BatchedMTP.observe`), so hand-over and restarts follow its rules.

The assistant has no cache: its slot in the batch's draft caches is one empty ragged
layer that is never written, so rows join, leave and migrate through the same
machinery as every model drafter's.
"""

from __future__ import annotations

import mlx.core as mx

from engines.batched.drafting import BatchRow, choose_tokens
from engines.batched.mtp import BatchedMTP
from engines.cache.ragged_cache import RaggedKVCache
from engines.drafting.assistant import shared_kv
from engines.drafting.draft import DRAFT
from engines.drafting.mtp import MTPState
from engines.faults import check


class AssistantRows(BatchedMTP):
    """The assistant as the batch's model drafter (the calls `BatchedMTP` answers)."""

    def join(self, row: BatchRow, draft=None, mtp: MTPState | None = None) -> list:
        row.drafting.mtp = (mtp or MTPState()) if DRAFT in row.drafting.gates else None
        if row.drafting.mtp is not None:
            row.drafting.mtp.target_cache = None  # the batch's rows are what it reads here
        return [RaggedKVCache([0])]

    def leave(self, cache: list[RaggedKVCache], rows: list[BatchRow], index: int):
        return None, rows[index].drafting.mtp

    def check(self, cache: list[RaggedKVCache], rows: list[BatchRow]) -> None:
        assert all(length == 0 for length in cache[0].lengths), "the assistant keeps no cache"

    def feed(self, cache: list[RaggedKVCache], rows: list[BatchRow]) -> None:
        for row in rows:
            if row.drafting.mtp is not None:
                self.drafter.feed(row.drafting.mtp)

    def draft(
        self, cache: list[RaggedKVCache], rows: list[BatchRow], target: list | None = None
    ) -> tuple[int, bool]:
        """`row.draft_length` drafts for every row drafting with the assistant whose
        state holds its target row's newest position (others draft nothing)."""
        steady = all(row.drafting.mtp is None or row.drafting.mtp.pending <= 2 for row in rows)
        self.feed(cache, rows)
        lengths = []
        for row in rows:
            state, held = row.drafting.mtp, len(row.tokens) - 1
            ok = (
                row.method == self.method
                and state is not None
                and state.newest is not None
                and state.start + state.length == held
            )
            if row.method == self.method and not ok:
                row.method, row.drafts, row.draft_length = None, [], 0
            lengths.append(row.draft_length if ok else 0)
        if any(lengths):
            self._chain(target, rows, lengths)
        check([rows[i] for i in self.drafting_rows(rows)], "draft")
        return max(lengths, default=0), steady

    def _chain(self, target: list, rows: list[BatchRow], lengths: list[int]) -> None:
        """One assistant step per drafted position over every row; each drafting row
        takes its token as a chained drafter does (`choose_tokens`)."""
        kv, slots = shared_kv(target, self.drafter.layers)
        like = next(row.drafting.mtp.newest for row, n in zip(rows, lengths, strict=True) if n)
        hidden = mx.stack(
            [
                row.drafting.mtp.newest if n else mx.zeros_like(like)
                for row, n in zip(rows, lengths, strict=True)
            ]
        )
        positions = mx.array([len(row.tokens) - 2 for row in rows])
        tokens = mx.array([[row.tokens[-1]] for row in rows], dtype=mx.int32)
        proposals: list[list[int]] = [[] for _ in rows]
        probs: list[list[mx.array]] = [[] for _ in rows]
        for step in range(max(lengths)):
            logits, hidden = self.drafter.module.step(tokens, hidden, kv, positions, slots)
            logits = logits[:, 0, : self.vocab_size].astype(mx.float32)
            drafting = [step < n for n in lengths]
            chosen = choose_tokens(rows, logits, drafting, proposals, probs)
            tokens = mx.array([[t] for t in chosen], dtype=mx.int32)
        for row, n, proposal, q in zip(rows, lengths, proposals, probs, strict=True):
            if n:
                row.drafts = proposal
                row.probs = mx.stack(q) if q else None

    def recover(self, cache: list[RaggedKVCache], rows: list[BatchRow], failed: list[int]) -> None:
        for i in failed:
            rows[i].drafting.mtp = None
