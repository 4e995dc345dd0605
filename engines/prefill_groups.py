"""Newcomers to the batch prefill in groups, each group in a ragged cache of its own.

A group's forward pads every row to its longest, so rows share a group only while
rows x longest pending prompt fits one prefill chunk: short prompts of a burst
prefill together, long ones alone, unpadded, one after another (measured on
Qwen2.5-Coder-0.5B, 7 prompts of 340-480 tokens: 98 tokens/s one by one, 71 padded
into one forward). Among groups the one with the least left prefills first, which
gives a burst its lowest median time to first token, but the oldest is passed over
at most `MAX_PASSED_OVER` times, so a stream of short prompts cannot starve a long one.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.batched_drafting import BatchRow
from engines.ragged_cache import RaggedKVCache

MAX_PASSED_OVER = 8


@dataclass
class PrefillGroup:
    """Newcomers prefilling together before they join the batch."""

    rows: list[BatchRow]
    cache: list[RaggedKVCache]
    draft_cache: list[RaggedKVCache] | None
    fed_with_target: bool = False  # the draft cache (the MTP head's) follows the target's
    started: bool = False
    passed_over: int = 0  # prefill chunks other groups ran while this one was oldest

    @property
    def pending(self) -> int:
        """Prompt tokens its widest row still has to prefill (the group's forward width)."""
        held = self.cache[0].held
        return max(len(r.tokens) - 1 - n for r, n in zip(self.rows, held, strict=True))

    def has_room(self, pending: int, chunk: int) -> bool:
        """Whether a row with `pending` prompt tokens to prefill may join: the group has
        not started and rows x widest chunk stays within one prefill chunk."""
        widest = max(pending, self.pending)
        return not self.started and (len(self.rows) + 1) * min(widest, chunk) <= chunk

    def prefilled(self, index: int) -> bool:
        """Row `index` holds all but its newest token, in the target and draft caches."""
        row = self.rows[index]
        target = self.cache[0].held[index] == len(row.tokens) - 1
        if self.draft_cache is None or self.fed_with_target:
            return target
        return target and len(row.draft_fed) == len(row.tokens) - 1


def next_group(groups: list[PrefillGroup]) -> PrefillGroup:
    """The group with the least left to prefill, unless the oldest has been passed over
    `MAX_PASSED_OVER` times."""
    oldest = groups[0]
    if oldest.passed_over >= MAX_PASSED_OVER:
        return oldest
    group = min(groups, key=lambda g: g.pending)  # the oldest among equals
    if group is not oldest:
        oldest.passed_over += 1
    return group
