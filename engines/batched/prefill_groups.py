"""Newcomers to the batch prefill in groups, each group in a ragged cache of its own.

A group's forward pads every row to its longest, so rows share a group only while
rows x longest pending prompt fits one prefill chunk: short prompts of a burst
prefill together, long ones alone, unpadded, one after another (measured on
Qwen2.5-Coder-0.5B, 7 prompts of 340-480 tokens: 98 tokens/s one by one, 71 padded
into one forward). Among groups the one with the least left prefills first, which
gives a burst its lowest median time to first token, but the oldest is passed over
at most `MAX_PASSED_OVER` times, so a stream of short prompts cannot starve a long one.
A row whose prompt is in gets its first token from one small forward of its group
(`first_tokens`) and joins the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache

from engines.batched.containment import failed_outputs, involved
from engines.batched.drafting import BatchRow, DraftModelRows
from engines.batched.verify import accept_rows, commit_row, process_rows
from engines.cache.ragged_cache import RaggedKVCache, feed_rows, remove_rows
from engines.faults import check
from engines.prompt_images import advance_towers, chunk_embeddings, whole_images
from engines.request import at_checkpoint, next_checkpoint
from engines.sequence import StepOutput
from engines.state import SequenceState

if TYPE_CHECKING:
    from engines.batched.mtp import BatchedMTP

MAX_PASSED_OVER = 8


@dataclass
class Checkpoints:
    """What prefill chunks keep for the prefix cache: `taken`, the states copied out
    (the engine's result's list), and whether rows stop at their prompts' checkpoint
    positions (`at_positions`: caches that cannot be cut back, and a prefix cache)."""

    taken: list[SequenceState]
    at_positions: bool


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

    def extract(self, index: int) -> SequenceState:
        """Row `index` with a copy of what its target cache holds (a cancelled prefill,
        kept for a retry)."""
        cache = [layer.extract(index) for layer in self.cache]
        if not can_trim_prompt_cache(cache):
            mx.eval([layer.state for layer in cache])  # not views of the group's
        return SequenceState(self.rows[index].seq, cache, self.cache[0].held[index])

    def checkpoints(
        self, before: list[int], untrimmable: bool, drafter: DraftModelRows | BatchedMTP | None
    ) -> list[SequenceState]:
        """Rows whose caches as they are now become prefix-cache entries, each row's
        copied out: with `untrimmable`, those whose prompt (or a checkpoint in it) was just
        prefilled (they held `before`) into caches that cannot be cut back later
        (recurrent state), so the same prompt again starts from here; and those that
        just reached a prompt position requests of their key wait for
        (`Sequence.keep_at`)."""
        taken = []
        for i, (row, held) in enumerate(zip(self.rows, self.cache[0].held, strict=True)):
            end = len(row.tokens) - 1
            if held == before[i]:
                continue
            awaited = held in row.seq.keep_at
            if not awaited and not (untrimmable and at_checkpoint(row.seq.request, held, end)):
                continue
            cache = [layer.extract(i) for layer in self.cache]
            if awaited or not can_trim_prompt_cache(cache):
                # with the draft model's cache, fed the prompt beside the target's: a
                # request starting here does not feed it the prompt again
                draft = None
                if self.draft_cache is not None:
                    draft = drafter.copy(self.draft_cache, self.rows, i)
                copied = [*cache, *(draft.cache if draft is not None else [])]
                mx.eval([layer.state for layer in copied])  # not views of the group's
                taken.append(SequenceState.entry(row.seq, cache, held, draft))
        return taken


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


def first_tokens(
    model, mtp: BatchedMTP | None, group: PrefillGroup, ready: list[int]
) -> list[StepOutput]:
    """Feed the newest token of the `ready` rows of `group` and commit the token that
    follows it, from one small forward of the group (not a verify of the whole batch,
    so time to first token is the prefill plus one token): afterwards each holds all
    but its newest token again."""
    fed = [[row.tokens[-1]] if i in ready else [] for i, row in enumerate(group.rows)]
    index = mx.array(ready, dtype=mx.int32)
    before = [group.cache[0].held[i] for i in ready]
    logits = feed_rows(model, group.cache, fed)[index]
    rows = [group.rows[i] for i in ready]
    fed_rows = [fed[i] for i in ready]
    logprobs = process_rows(rows, logits, fed_rows)
    decisions = accept_rows(rows, logprobs, fed_rows)
    if mtp is not None:
        mtp.observe(rows, before, [[token] for _, token in decisions], index)
    outputs = []
    for j, (row, (_, token)) in enumerate(zip(rows, decisions, strict=True)):
        for gate in row.drafting.gates.values():
            gate.plain_token()
        outputs.append(commit_row(row, [token], logprobs[j]))
    return outputs


def prefill_chunk(
    model,
    drafter,
    mtp: BatchedMTP | None,
    group: PrefillGroup,
    chunk: int,
    checkpoints: Checkpoints,
    feed: Callable = feed_rows,
    vision: Any = None,
) -> tuple[list[int], list[StepOutput]]:
    """Feed the group's rows their next `chunk` of prompt (target and draft caches,
    up to a prompt checkpoint when `checkpoints.at_positions`); the rows whose prompts
    are then in get their first tokens: (their indices, outputs). What becomes a
    prefix-cache entry is added to `checkpoints.taken`. `feed` runs the target forward
    (`feed_rows`'s signature): a packed one carries the decoding rows' step along
    (`packed_forward`). A chunk reaching a prompt image is fed as input embeddings
    (`prompt_images`, with the model's `vision` half)."""
    before = list(group.cache[0].held)
    chunks = [
        r.tokens[held : _chunk_end(r, held, chunk, checkpoints.at_positions, vision)]
        for r, held in zip(group.rows, before, strict=True)
    ]
    towers = [(r.seq, held, ids) for r, held, ids in zip(group.rows, before, chunks, strict=True)]
    # a row whose chunk reaches an image runs its vision tower a layer at a step first
    waiting = (
        advance_towers(vision, towers) if any(r.seq.request.images for r in group.rows) else ()
    )
    chunks = [[] if i in waiting else ids for i, ids in enumerate(chunks)]
    if any(chunks):
        rows = zip(group.rows, before, chunks, strict=True)
        embeddings = chunk_embeddings(vision, [(r.seq, held, ids) for r, held, ids in rows])
        feed(model, group.cache, chunks, embeddings)
    after = list(group.cache[0].held)
    for row, held in zip(group.rows, after, strict=True):
        row.seq.prefilled = held
    if group.draft_cache is not None:
        drafter.prefill(group.rows, group.draft_cache, before, after)
    # Evaluate all of it now, so no later step's timing absorbs this prefill.
    layers = [*group.cache, *(group.draft_cache or [])]
    mx.eval([layer.state for layer in layers if layer.nbytes])
    check(group.rows, "prefill")
    checkpoints.taken += group.checkpoints(before, checkpoints.at_positions, drafter)
    ready = [i for i, row in enumerate(group.rows) if group.prefilled(i)]
    return ready, first_tokens(model, mtp, group, ready) if ready else []


def _chunk_end(row: BatchRow, held: int, chunk: int, checkpoint: bool, vision: Any) -> int:
    """Where the row's next chunk ends: `chunk` tokens on, or sooner at its prefill's
    end, and never inside an image that attends both ways (`whole_images`)."""
    stop = min(_prefill_end(row, held, checkpoint), held + chunk)
    return whole_images(vision, row.seq, held, stop)


def _prefill_end(row: BatchRow, held: int, checkpoint: bool) -> int:
    """Where the row's prefill stops next: its prompt's end, a checkpoint, or a
    position to keep."""
    end = len(row.tokens) - 1
    if checkpoint:
        end = next_checkpoint(row.seq.request, held, end)
    return row.seq.prefill_stop(held, end)


def take_ready(
    groups: list[PrefillGroup], group: PrefillGroup, ready: list[int]
) -> tuple[list[BatchRow], list, list | None]:
    """The `ready` rows of `group` with their target and draft cache rows, taken out
    of it (the group leaves `groups` when all its rows are ready)."""
    rows = [group.rows[i] for i in ready]
    if len(ready) == len(group.rows):
        groups.remove(group)
        return rows, group.cache, group.draft_cache
    # short prompts start decoding while long ones keep prefilling
    cache = [layer.take(ready) for layer in group.cache]
    draft = [layer.take(ready) for layer in group.draft_cache or []] or None
    remove_rows(group.rows, group.cache, group.draft_cache, ready)
    return rows, cache, draft


def leave_group(groups: list[PrefillGroup], group: PrefillGroup, indices: list[int]) -> None:
    """Rows leave `group` (finished, cancelled, handed over); an empty group goes."""
    remove_rows(group.rows, group.cache, group.draft_cache, indices)
    if not group.rows:
        groups.remove(group)


def prefill_next(
    groups: list[PrefillGroup],
    model,
    drafter,
    mtp: BatchedMTP | None,
    chunk: int,
    checkpoints: Checkpoints,
    contain: bool,
    feed: Callable = feed_rows,
    vision: Any = None,
) -> tuple[tuple[list[BatchRow], list, list | None] | None, list[StepOutput]]:
    """One chunk of the next group (`next_group`, `prefill_chunk`): the rows whose
    prompts are then in, taken out to join the batch with their target and draft cache
    rows (None: none), and the outputs (their first tokens). With `contain`, a failed
    chunk ends only the rows it belongs to (`containment`): they leave the group, each
    with an error output."""
    group = next_group(groups)
    group.started = True
    try:
        ready, outputs = prefill_chunk(model, drafter, mtp, group, chunk, checkpoints, feed, vision)
    except Exception as exc:  # noqa: BLE001 - the group's rows fail, the batch goes on
        if not contain:
            raise
        failed = involved(exc, group.rows)
        rows = [group.rows[i] for i in failed]
        leave_group(groups, group, failed)
        return None, failed_outputs(rows, exc, "a prefill chunk")
    if not ready:
        return None, outputs
    return take_ready(groups, group, ready), outputs
