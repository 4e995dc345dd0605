"""The batched speculative engine's rows: who is in the batch or prefilling, and rows
moving in and out with their caches.

A sequence joins with its cache as it is (`take_over`): one already generating whose
cache holds all but its newest token joins the batch at once, the others prefill in
groups first (`prefill_groups`). A sequence leaves (`hand_over`) with the target cache
of its committed tokens and its model drafter's state, so a migration never
re-prefills; a finished row leaves its cache for prefix reuse (`_release`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from engines.batched.containment import join_rows
from engines.batched.drafting import BatchRow, DraftModelRows
from engines.batched.pipeline import InFlight
from engines.batched.prefill_groups import PrefillGroup, leave_group
from engines.cache.ragged_cache import RaggedKVCache, ragged_from_rows, remove_rows
from engines.drafting.draft_model import DraftState
from engines.drafting.mtp import MTPState
from engines.faults import check
from engines.interface import StepResult, starting_state
from engines.sequence import FinishReason, Sequence, StepOutput
from engines.spec_config import SpecConfig
from engines.state import SequenceState, resume_drafter

if TYPE_CHECKING:
    from engines.batched.mtp import BatchedMTP
    from engines.gating.draft_limits import DraftLimits
    from engines.model.registry import ModelRegistry


class BatchMembership:
    """The rows and prefill groups of `BatchedSpeculativeEngine` (which sets these
    fields and runs the steps). Owned by the engine thread: every field is read and
    changed there only."""

    registry: ModelRegistry
    config: SpecConfig
    limits: DraftLimits
    model_drafter: DraftModelRows | BatchedMTP | None
    prefill_step_size: int
    recurrent: bool  # a hybrid's recurrent rows cannot be cut back when a row leaves
    rows: list[BatchRow]
    cache: list[RaggedKVCache]
    draft_cache: list[RaggedKVCache] | None
    groups: list[PrefillGroup]
    in_flight: InFlight | None
    _result: StepResult

    def settle(self) -> StepResult:
        raise NotImplementedError

    def _settle_in_flight(self) -> list[StepOutput]:
        raise NotImplementedError

    @property
    def batch_size(self) -> int:
        return len(self.rows) + sum(len(g.rows) for g in self.groups)

    @property
    def active_ids(self) -> list[str]:
        return [row.seq.request_id for row in self._all_rows()]

    def _all_rows(self) -> list[BatchRow]:
        return [*self.rows, *(row for group in self.groups for row in group.rows)]

    @property
    def has_capacity(self) -> bool:
        return True

    def admit(self, start: Sequence | SequenceState) -> None:
        """A new request starts: from an empty cache, or a cached prefix of its prompt."""
        self.take_over(starting_state(start, self.registry.target.model))

    def take_over(self, state: SequenceState) -> None:
        """Join with the cache as it is. A sequence already generating (a migration)
        whose cache holds all but its newest token joins the batch now; the others go
        to the newest group while it has room (`_group_with_room`), or a new one. A
        group prefills what its rows' caches lack and gives each its first token from
        one small forward of the group -- also a prompt found whole in the prefix
        cache, whose first token would otherwise wait for a verify of the whole batch
        at its full draft length."""
        seq = state.seq
        drafter = self.model_drafter
        state = resume_drafter(state, getattr(drafter, "entry_ahead", None))
        drafting = state.drafting  # the request's own, kept as the same object
        drafting.fill(self.limits, seq)
        row = BatchRow(seq, drafting)
        draft, drafting.draft = drafting.draft, None  # its cache becomes the batch's row
        draft_rows = drafter.join(row, draft, drafting.mtp) if drafter else None
        ready = state.cached == len(seq.all_tokens) - 1
        if ready and seq.generated and not self.groups:
            check([row], "insert")
            self._result.outputs += self._settle_in_flight()  # rows join only a settled batch
            self._join([row], [list(state.cache)], draft_rows)
            return
        group = self._group_with_room(len(seq.all_tokens) - 1 - state.cached)
        cache = ragged_from_rows([list(state.cache)])
        draft = ragged_from_rows([draft_rows]) if draft_rows is not None else None
        if group is None:
            check([row], "insert")
            fed_with_target = drafter is not None and drafter.fed_with_target
            self.groups.append(PrefillGroup([row], cache, draft, fed_with_target))
            return
        layers = [*group.cache, *(group.draft_cache or [])]
        join_rows(
            group.rows, layers, [row], [*cache, *(draft or [])], lambda: check([row], "insert")
        )

    def _group_with_room(self, pending: int) -> PrefillGroup | None:
        """The newest group, if a row with `pending` prompt tokens to prefill fits it."""
        group = self.groups[-1] if self.groups else None
        return group if group and group.has_room(pending, self.prefill_step_size) else None

    def _join(self, rows: list[BatchRow], caches: list[list], draft_rows: list | None) -> None:
        draft = ragged_from_rows([draft_rows]) if draft_rows is not None else None
        self._merge(rows, ragged_from_rows(caches), draft)

    def _merge(
        self, rows: list[BatchRow], cache: list[RaggedKVCache], draft: list[RaggedKVCache] | None
    ) -> None:
        """Rows join the running batch, all or nothing (`containment.join_rows`)."""
        if not self.rows:
            check(rows, "merge")
            self.rows, self.cache, self.draft_cache = list(rows), cache, draft
            return
        layers = [*self.cache, *(self.draft_cache or [])]
        join_rows(self.rows, layers, rows, [*cache, *(draft or [])], lambda: check(rows, "merge"))

    def hand_over(self, request_id: str) -> tuple[SequenceState | None, StepResult]:
        """Leave the batch, a plain step in flight committed first (`settle`; None for
        the state when that commit finished the request)."""
        result = self.settle()
        if request_id not in self.active_ids:
            return None, result
        return self._extract(request_id), result

    def _extract(self, request_id: str) -> SequenceState:
        """Leave with the target cache of every committed token but the newest, and the
        draft cache of exactly `draft_fed` -- or, from a group still prefilling, with
        what the group has prefilled so far (the receiving engine prefills the rest;
        finishing the prefill here would commit a first token nobody publishes)."""
        group, i = self._find(request_id)
        assert group is not None or self.in_flight is None, "settle() before a row leaves"
        rows, cache, draft_cache = (
            (group.rows, group.cache, group.draft_cache)
            if group
            else (self.rows, self.cache, self.draft_cache)
        )
        row = rows[i]
        cached = cache[0].held[i] if group else len(row.tokens) - 1
        layers = [layer.extract(i) for layer in cache]
        draft, mtp = self._drafter_states(draft_cache, rows, i)
        self._remove(group, i)
        # its own caches again (a feature drafter's state, not the entry it would leave)
        row.drafting.draft, row.drafting.mtp = (draft, None) if mtp is None else (None, mtp)
        return SequenceState(row.seq, layers, cached, row.drafting)

    def _drafter_states(
        self, draft_cache: list | None, rows: list[BatchRow], index: int
    ) -> tuple[DraftState | None, MTPState | None]:
        """What a leaving row's model drafter holds: its draft state or MTP state."""
        return self.model_drafter.leave(draft_cache, rows, index) if draft_cache else (None, None)

    def cancel(self, request_id: str, keep: bool = False) -> bool:
        """End the request; with `keep` (a client's cancel, not a failure) its cache --
        the prompt prefilled so far, or prompt and output -- goes to the next result
        (`released` from the batch, `checkpoints` from a prefill group), so a retry of
        the same prompt resumes from it instead of prefilling again."""
        group, i = self._find(request_id)
        if i < 0:
            return False
        (group.rows if group else self.rows)[i].seq.finish_reason = FinishReason.CANCELLED
        if keep and group is None:
            self._release([i])  # leaves the batch with its cache kept
            return True
        if keep and group.cache[0].held[i] > 0:
            self._result.checkpoints.append(group.extract(i))
        self._remove(group, i)
        return True

    def copy_cache(self, request_id: str) -> SequenceState | None:
        """A copy of a decoding row's target cache of the committed tokens it holds (a
        plain step in flight, which fed the newest, is evaluated for it), and of its
        draft model's, for the prefix cache; the row goes on unchanged. None: not here,
        or still prefilling."""
        group, i = self._find(request_id)
        if i < 0 or group is not None:
            return None
        layers = [layer.extract(i) for layer in self.cache]
        draft = None
        if self.draft_cache is not None:
            draft = self.model_drafter.copy(self.draft_cache, self.rows, i)
        copied = [*layers, *(draft.cache if draft is not None else [])]
        mx.eval([layer.state for layer in copied])  # own arrays, not views of the batch's
        return SequenceState.entry(self.rows[i].seq, layers, self.cache[0].held[i], draft)

    def _find(self, request_id: str) -> tuple[PrefillGroup | None, int]:
        """Where a row is: (its prefill group, its index there), or (None, its index in
        the batch); (None, -1) when it is in neither."""
        for group in self.groups:
            for i, row in enumerate(group.rows):
                if row.seq.request_id == request_id:
                    return group, i
        ids = [row.seq.request_id for row in self.rows]
        return None, ids.index(request_id) if request_id in ids else -1

    def _remove(self, group: PrefillGroup | None, index: int) -> None:
        if group is not None:
            leave_group(self.groups, group, [index])
        else:
            self._drop([index])

    def _drop(self, indices: list[int]) -> None:
        if self.in_flight is not None:
            keep = [i for i in range(len(self.rows)) if i not in set(indices)]
            self.in_flight = self.in_flight.kept(keep) if keep else None
        remove_rows(self.rows, self.cache, self.draft_cache, indices)

    def _release(self, finished: list[int]) -> None:
        """Finished rows leave; each leaves its cache trimmed to the committed tokens
        it holds (a row whose commit failed holds tokens it did not commit: the trim
        removes them too), and its draft cache of the committed tokens it holds."""
        for i in finished:
            row = self.rows[i]
            held = min(self.cache[0].held[i], len(row.tokens))
            if held != self.cache[0].held[i] and self.recurrent:
                continue  # recurrent state past the committed tokens: nothing to reuse
            for layer in self.cache:
                layer.held[i] = held
            cache = [layer.extract(i) for layer in self.cache]
            draft, _ = self._drafter_states(self.draft_cache, self.rows, i)
            self._result.released.append(SequenceState.entry(row.seq, cache, held, draft))
        if finished:
            self._drop(finished)
