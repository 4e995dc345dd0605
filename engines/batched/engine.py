"""The batched speculative engine: every running sequence drafts its own tokens and
one target forward verifies them all, so speculation stays on when users arrive.

Each step:
  1. join: newcomers' prompts are prefilled in groups (`prefill_groups`), one
     chunk per step, each group in a ragged cache of its own (the running rows keep
     their cadence); a row whose prompt is in joins the batch;
  2. plan: each row proposes from its own n-gram index (PLD); rows that draft with
     the model drafter -- a draft model (`batched_drafting`) or the target's MTP head
     (`batched_mtp`) -- share one batched forward per drafted position, on a ragged
     draft cache aligned row for row with the target's. The step's draft
     length K maximises expected committed tokens per second (`batch_costs`):
     K = 0 is plain batching, one row is the single-stream rule;
  3. verify: one target forward over `[B, 1 + K]` (shorter drafts padded at the
     end, which no real position attends), the exact acceptance rule per row with
     that row's sampling settings, processors and RNG (greedy: the argmax; seeded:
     the plain seeded sample at each position; otherwise Leviathan's rejection
     rule), then each row rolls back to exactly its committed tokens.
     While K = 0 and no newcomer prefills, plain steps are queued one ahead
     (`batched_pipeline`): the next forward runs while this one's tokens are
     committed and published.

Hybrid models (recurrent layers beside attention) batch the same way: their recurrent
layers hold one `RaggedArraysCache` row per sequence, a verify captures those layers'
inputs, and each row's state is restored and rerun on exactly its kept tokens
(`rollback.roll_back_rows`) while the KV layers cut their rows. Sliding-window layers
keep each row's window in order (`RaggedKVCache` with a `window`) and cut like KV.

Invariant after every step: target row i holds exactly `seq.all_tokens[:-1]` (the
newest token is its next input) -- or, while a plain step is in flight, exactly
`seq.all_tokens`, the in-flight token being sampled but not committed -- and draft
row i holds what its model drafter's invariant says. Both are checked every step. Requests
move in and out with their caches (`insert` / `extract`, after `settle` commits a
step in flight), so migration never re-prefills.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engines.batched.containment import failed_outputs, involved, join_rows
from engines.batched.costs import BatchCosts, BatchPlan
from engines.batched.drafting import BatchRow, DraftModelRows, plan_rows
from engines.batched.mtp import BatchedMTP
from engines.batched.pipeline import InFlight, pipelinable, queue_plain
from engines.batched.prefill_groups import PrefillGroup, next_group, prefill_chunk, take_ready
from engines.batched.verify import accept_rows, commit_row, process_rows
from engines.cache.ragged_cache import RaggedKVCache, ragged_from_rows, remove_rows
from engines.cache.ragged_recurrent import is_recurrent
from engines.cache.rollback import capturing_inputs, restore_rows, roll_back_rows, take_snapshot
from engines.drafting.draft import DRAFT, LOOKUPS, MTP
from engines.drafting.draft_model import DraftState
from engines.drafting.mtp import MTPState
from engines.drafting.prompt_lookup import PromptLookupDrafter
from engines.faults import check
from engines.model.registry import ModelRegistry
from engines.sequence import FinishReason, Sequence, StepOutput
from engines.single.engine import SpeculativeEngine
from engines.state import SequenceState, SpecConfig

log = logging.getLogger(__name__)

MAX_HOST_GAP = 0.5  # seconds between steps beyond which the caller idled, not worked


class BatchedSpeculativeEngine:
    name = "batched"

    def __init__(
        self,
        registry: ModelRegistry,
        speculative: SpeculativeEngine,
        prefill_step_size: int = 512,
        costs: BatchCosts | None = None,
    ) -> None:
        self.registry = registry
        self.model = registry.model_for(self.name)
        # a hybrid's recurrent rows cannot be cut back when a finished row leaves
        self.recurrent = any(is_recurrent(c) for c in make_prompt_cache(registry.target.model))
        self.model_drafter = self._model_drafter(speculative, prefill_step_size)
        # the MTP head needs the hidden states of every target forward of the batch
        self.mtp = self.model_drafter if isinstance(self.model_drafter, BatchedMTP) else None
        if self.mtp is not None:
            self.model = self.mtp.target  # the same ops and logits, run in two parts
        self.config: SpecConfig = speculative.config
        self.limits = speculative.limits  # a migrating request keeps its limits
        self.costs = costs or BatchCosts(speculative.cost, learn=speculative.costs.learn)
        self.prefill_step_size = prefill_step_size
        self.contain = registry.lockstep is None  # a failure stays with its rows (`containment`)
        self.rows: list[BatchRow] = []
        self.cache: list[RaggedKVCache] = []
        self.draft_cache: list[RaggedKVCache] | None = None
        self.groups: list[PrefillGroup] = []
        self._prefilled_last = False  # the previous step was a prefill chunk
        self.released: list[SequenceState] = []  # finished sequences' caches, for reuse
        self.checkpoint_prompts = False  # keep prompt checkpoints (there is a prefix cache)
        self.checkpoints: list[SequenceState] = []  # prefilled prompts' caches, for reuse
        self.step_sizes: list[tuple[int, int]] = []  # (rows, drafted) per row this step
        self.forward_seconds = 0.0  # model time of the last step (the rest is overhead)
        self.in_flight: InFlight | None = None  # a plain step queued ahead (`batched_pipeline`)
        self.settled: list[StepOutput] = []  # outputs of a settle outside `step`, not yet returned
        self._plain_ahead = False  # the plan after the newest commit was plain
        self._pipelined_at: float | None = None  # when the last call that queued a step ended
        self._returned_at: float | None = None  # when the last step with rows returned
        self._host_seconds = 0.0  # the caller's time between that return and this step

    def _model_drafter(
        self, speculative: SpeculativeEngine, chunk: int
    ) -> DraftModelRows | BatchedMTP | None:
        """The draft model, or else the target's own MTP head, or nothing."""
        registry = self.registry
        vocab = speculative.drafter.vocab_size if speculative.drafter else 0
        if registry.draft is not None:
            return DraftModelRows(registry.draft.model, vocab, chunk)
        if registry.mtp is not None:
            return BatchedMTP(registry.mtp, registry.target.model, self.model, vocab)
        return None

    # ---- membership -----------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return len(self.rows) + sum(len(g.rows) for g in self.groups)

    @property
    def active_ids(self) -> list[str]:
        return [row.seq.request_id for row in self._all_rows()]

    def _all_rows(self) -> list[BatchRow]:
        return [*self.rows, *(row for group in self.groups for row in group.rows)]

    def add(self, seq: Sequence) -> None:
        self.insert(SequenceState(seq, make_prompt_cache(self.registry.target.model), 0))

    def insert(self, state: SequenceState) -> None:
        """Join with the cache as it is. A sequence already generating (a migration)
        whose cache holds all but its newest token joins the batch now; the others go
        to the newest group while it has room (`_group_with_room`), or a new one. A
        group prefills what its rows' caches lack and gives each its first token from
        one small forward of the group -- also a prompt found whole in the prefix
        cache, whose first token would otherwise wait for a verify of the whole batch
        at its full draft length."""
        seq = state.seq
        gates = state.gates if state.gates is not None else self.limits.initial_gates(seq)
        pld = state.pld or PromptLookupDrafter(max_ngram=self.config.pld_max_ngram)
        row = BatchRow(seq, gates, pld)
        drafter = self.model_drafter
        draft_rows = drafter.join(row, state.draft, state.mtp) if drafter else None
        ready = state.cached == len(seq.all_tokens) - 1
        if ready and seq.generated and not self.groups:
            check([row], "insert")
            self.settled += self._settle_in_flight()  # rows join only a settled batch
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

    admit = insert

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

    def extract(self, request_id: str) -> SequenceState:
        """Leave with the target cache of every committed token but the newest, and the
        draft cache of exactly `draft_fed` -- or, from a group still prefilling, with
        what the group has prefilled so far (the receiving engine prefills the rest;
        finishing the prefill here would commit a first token nobody publishes)."""
        for group in self.groups:
            for i, row in enumerate(group.rows):
                if row.seq.request_id == request_id:
                    cached = group.cache[0].held[i]
                    cache = [layer.extract(i) for layer in group.cache]
                    draft, mtp = self._drafter_states(group.draft_cache, group.rows, i)
                    self._leave_group(group, [i])
                    return SequenceState(row.seq, cache, cached, row.gates, row.pld, draft, mtp)
        assert self.in_flight is None, "settle() the batch before a row leaves it"
        index = self._index(request_id)
        row = self.rows[index]
        cache = [layer.extract(index) for layer in self.cache]
        draft, mtp = self._drafter_states(self.draft_cache, self.rows, index)
        self._drop([index])
        cached = len(row.tokens) - 1
        return SequenceState(row.seq, cache, cached, row.gates, row.pld, draft, mtp)

    def _drafter_states(
        self, draft_cache: list | None, rows: list[BatchRow], index: int
    ) -> tuple[DraftState | None, MTPState | None]:
        """What a leaving row's model drafter holds: its draft state or MTP state."""
        return self.model_drafter.leave(draft_cache, rows, index) if draft_cache else (None, None)

    def cancel(self, request_id: str) -> bool:
        for group in self.groups:
            for i, row in enumerate(group.rows):
                if row.seq.request_id == request_id:
                    row.seq.finish_reason = FinishReason.CANCELLED
                    self._leave_group(group, [i])
                    return True
        for i, row in enumerate(self.rows):
            if row.seq.request_id == request_id:
                row.seq.finish_reason = FinishReason.CANCELLED
                self._drop([i])
                return True
        return False

    def _leave_group(self, group: PrefillGroup, indices: list[int]) -> None:
        remove_rows(group.rows, group.cache, group.draft_cache, indices)
        if not group.rows:
            self.groups.remove(group)

    def _index(self, request_id: str) -> int:
        return next(i for i, row in enumerate(self.rows) if row.seq.request_id == request_id)

    def _drop(self, indices: list[int]) -> None:
        if self.in_flight is not None:
            keep = [i for i in range(len(self.rows)) if i not in set(indices)]
            self.in_flight = self.in_flight.kept(keep) if keep else None
        remove_rows(self.rows, self.cache, self.draft_cache, indices)

    # ---- the step ---------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One step (`_step`), and the host time since the last one returned: what the
        caller did in between (publishing that step's outputs), which a pipelined plain
        step overlaps with its forward and a drafting step waits for."""
        began = time.perf_counter()
        returned, self._returned_at = self._returned_at, None
        gap = began - returned if returned is not None else 0.0
        self._host_seconds = gap if gap < MAX_HOST_GAP else 0.0  # longer: the caller idled
        outputs = self._step()
        if self.rows:
            self._returned_at = time.perf_counter()
        return outputs

    def _step(self) -> list[StepOutput]:
        outputs, self.settled = self.settled, []
        self.forward_seconds = 0.0
        self.step_sizes = []
        if self.in_flight is not None:
            keep_going = self._plain_ahead and not self.groups and pipelinable(self.rows)
            return outputs + self._commit_in_flight(queue_next=keep_going)
        if self.groups and not (self.rows and self._prefilled_last):
            # A prefill chunk is a step of its own, alternating with verifies while rows
            # decode (they wait for one chunk or one verify, never both); it returns the
            # first tokens of the prompts it completes.
            self._prefilled_last = True
            return outputs + self._prefill_chunk()
        self._prefilled_last = False
        if not self.rows:
            return outputs
        started, rows = time.perf_counter(), len(self.rows)
        plan = self._plan()
        probe = self.costs.plain_probe_due(rows)  # a plain step to measure, not a run
        if plan.k == 0 and not probe and not self.groups and pipelinable(self.rows):
            return outputs + self._start_pipeline()
        return outputs + self._drafting_step(plan, started, rows)

    def settle(self) -> list[StepOutput]:
        """Commit a plain step still in flight, so every row holds all its committed
        tokens but the newest again (before a row leaves: a migration, a pause); returns
        its outputs and any an earlier settle kept."""
        outputs, self.settled = self.settled, []
        return outputs + self._settle_in_flight()

    def _settle_in_flight(self) -> list[StepOutput]:
        return self._commit_in_flight(queue_next=False) if self.in_flight is not None else []

    def _start_pipeline(self) -> list[StepOutput]:
        """Queue this plain step, then hand over to `_commit_in_flight`, which queues
        the next one before reading this one."""
        started = time.perf_counter()
        inputs = mx.array([row.tokens[-1] for row in self.rows])
        self._queue_plain(inputs, ahead=0)
        self.forward_seconds += time.perf_counter() - started
        self._pipelined_at = None  # two steps queued at once: the first is no cadence
        return self._commit_in_flight(queue_next=True)

    def _commit_in_flight(self, queue_next: bool) -> list[StepOutput]:
        """Commit the plain step in flight; with `queue_next`, queue the next plain step
        first (fed the lazy tokens), so committing, detokenizing and publishing overlap
        its forward. Whether the step after that is plain again is planned from the
        tokens just committed: a row that starts to copy its context drafts one step
        later than it would unpipelined, never wrongly."""
        started = time.perf_counter()
        current, self.in_flight = self.in_flight, None
        if queue_next:
            self._queue_plain(current.tokens, ahead=1)
        tokens = current.tokens.tolist()
        self.forward_seconds += time.perf_counter() - started
        held = 0 if queue_next else 1  # tokens a row's cache lacks after the commit
        outputs, finished = [], []
        for i, (row, token) in enumerate(zip(self.rows, tokens, strict=True)):
            for gate in row.gates.values():
                gate.plain_token()
            self.step_sizes.append((current.width, 0))
            output = commit_row(row, [token], current.logprobs[i : i + 1])
            if output.finish_reason is not None:
                finished.append(i)
            else:
                assert self.cache[0].held[i] == len(row.tokens) - held, "row out of step"
            outputs.append(output)
        self._release(finished)
        self._observe_plain_cadence(current.width, len(outputs), queue_next)
        self._plain_ahead = queue_next and bool(self.rows) and self._plan().k == 0
        return outputs

    def _queue_plain(self, inputs: mx.array, ahead: int) -> None:
        """Queue a plain step; the MTP head gets each row's pair (lazily) at once."""
        before = list(self.cache[0].held)
        self.in_flight = queue_plain(self.model, self.cache, self.rows, inputs, ahead)
        if self.mtp is not None:
            tokens = self.in_flight.tokens
            self.mtp.observe(self.rows, before, [tokens[i : i + 1] for i in range(len(self.rows))])

    def _observe_plain_cadence(self, rows: int, committed: int, queued: bool) -> None:
        """A plain step as served in the pipeline costs the time between two commits
        (the host's work overlaps the forward): what a drafting step must beat. Only
        steady calls count, each of which queued a step: where `async_eval` runs most
        of a forward before returning (MLX on a CPU), the call that starts a pipeline
        pays for two steps and the one that ends it for almost none."""
        now = time.perf_counter()
        if self._pipelined_at is not None and queued:
            seconds = now - self._pipelined_at
            self.costs.observe_target(rows, seconds)
            self.costs.observe_outcome(rows, self.costs.plain_plan(rows), committed, seconds)
        self._pipelined_at = now if queued else None

    def _drafting_step(self, plan: BatchPlan, started: float, rows: int) -> list[StepOutput]:
        """A verify of the plan's drafts (or an unpipelined plain step), timed."""
        k = plan.k
        if plan.with_model:
            drafting = time.perf_counter()
            forwards, steady = self.model_drafter.draft(self.draft_cache, self.rows)
            seconds = time.perf_counter() - drafting
            self.forward_seconds += seconds
            if steady and forwards:  # a long catch-up is not what each drafted token costs
                self.costs.observe_draft(len(self.rows), seconds / forwards)
        outputs = self._verify(k)
        committed = sum(len(output.token_ids) for output in outputs)
        # judged like a plain step's cadence (from the previous step's return, so the
        # caller's host work counts), or drafting that loses as served would look cheap
        seconds = time.perf_counter() - started + self._host_seconds
        self.costs.observe_outcome(rows, plan, committed, seconds)
        return outputs

    def _prefill_chunk(self) -> list[StepOutput]:
        """One chunk of every prompt in a group (`_next_group`; target and draft caches).
        A row whose cache then holds all but its newest token gets its next token from
        one small forward of the group (not a verify of the whole batch, so time to
        first token is the prefill plus one token) and joins the batch."""
        group = next_group(self.groups)
        group.started = True
        started = time.perf_counter()
        checkpoints = self.checkpoints if self.checkpoint_prompts else None
        try:
            ready, outputs = prefill_chunk(
                self.model, self.model_drafter, self.mtp, group, self.prefill_step_size, checkpoints
            )
        except Exception as exc:  # noqa: BLE001 - the group's rows fail, the batch goes on
            if not self.contain:
                raise
            failed = involved(exc, group.rows)
            rows = [group.rows[i] for i in failed]
            self._leave_group(group, failed)
            return failed_outputs(rows, exc, "a prefill chunk")
        finally:
            self.forward_seconds += time.perf_counter() - started
        if not ready:
            return []
        joined = len(self.rows)
        rows, cache, draft = take_ready(self.groups, group, ready)
        try:
            self._merge(rows, cache, draft)
        except Exception as exc:  # noqa: BLE001 - the joining rows fail, the batch goes on
            if not self.contain:
                raise
            return outputs + failed_outputs(rows, exc, "joining the batch")
        done = {o.request_id for o in outputs if o.finish_reason is not None}
        self._release(
            [i for i in range(joined, len(self.rows)) if self.rows[i].seq.request_id in done]
        )
        return outputs

    # ---- planning -----------------------------------------------------------------------

    def _plan(self) -> BatchPlan:
        """Each row's PLD proposal and drafting options; the step's plan."""
        drafter = self.model_drafter.method if self.model_drafter else None
        return plan_rows(self.rows, self.costs, self._row_cap, drafter)

    def _row_cap(self, row: BatchRow, method: str) -> int:
        """The longest draft `method` may propose for the row: the single-stream rule,
        with lookup held to the draft model's cap (one row's long lookup draft would pad
        every row's verify)."""
        if not row.gates:
            return 0
        seq = row.seq
        k = min(self.limits.request_k(seq, method), self.limits.k_cap)
        return max(0, min(k, seq.request.max_tokens - len(seq.generated) - 1))

    # ---- verification -----------------------------------------------------------------

    def _verify(self, k: int) -> list[StepOutput]:
        started = time.perf_counter()
        width = 1 + k
        fed_rows = [[row.tokens[-1], *row.drafts[:k]] for row in self.rows]
        lengths = list(self.cache[0].held)
        inputs = mx.array([fed + [0] * (width - len(fed)) for fed in fed_rows])
        snapshot = take_snapshot(self.cache)  # None unless rows hold recurrent state
        try:
            with capturing_inputs(self.registry.target.model, self.cache, snapshot):
                logits = self.model(inputs, cache=self.cache)
            logprobs = process_rows(self.rows, logits, fed_rows)
            decisions = accept_rows(self.rows, logprobs, fed_rows)
            check(self.rows, "verify")
        except Exception as exc:  # noqa: BLE001 - undo the forward; its rows fail, not all
            if not self.contain:
                raise
            restore_rows(self.cache, snapshot, lengths)
            failed = involved(exc, self.rows)
            outputs = failed_outputs([self.rows[i] for i in failed], exc, "a verify")
            self._drop(failed)
            return outputs
        if self.mtp is not None:  # each row's kept positions, with the token after each
            following = [
                [*fed[1 : 1 + a], t] for fed, (a, t) in zip(fed_rows, decisions, strict=True)
            ]
            self.mtp.observe(self.rows, lengths, following)
        self.costs.observe_target(len(self.rows) * width, time.perf_counter() - started)
        self.forward_seconds += time.perf_counter() - started
        kept = [
            length + 1 + accepted for length, (accepted, _) in zip(lengths, decisions, strict=True)
        ]
        if snapshot is not None:  # recurrent layers: restore, rerun on each row's kept run
            roll_back_rows(self.cache, snapshot, lengths, kept)
        else:
            for layer in self.cache:
                layer.set_lengths(kept)
        outputs, finished = [], []
        for i, (row, fed, (accepted, next_token)) in enumerate(
            zip(self.rows, fed_rows, decisions, strict=True)
        ):
            drafted = len(fed) - 1
            if drafted:
                self._record(row, drafted, accepted)
            else:
                for gate in row.gates.values():
                    gate.plain_token()
            self.step_sizes.append((len(self.rows), drafted))
            output = commit_row(row, [*fed[1 : 1 + accepted], next_token], logprobs[i])
            if output.finish_reason is not None:
                finished.append(i)
            else:
                assert self.cache[0].held[i] == len(row.tokens) - 1, "target row out of step"
            outputs.append(output)
        if self.draft_cache is not None:
            self.model_drafter.check(self.draft_cache, self.rows)
        self._release(finished)
        return outputs

    def _record(self, row: BatchRow, drafted: int, accepted: int) -> None:
        row.seq.spec.record(row.method, drafted, accepted)
        method = DRAFT if row.method == MTP else row.method  # one gate per model drafter
        gate = row.gates[method]
        k_max = self._row_cap(row, method) or drafted
        match = row.match if row.method in LOOKUPS else 0
        if gate.record(drafted, accepted, k_max, self.costs.prior, match=match):
            row.seq.spec.trip("runtime")

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
            self.released.append(SequenceState(row.seq, cache, held, draft=draft))
        if finished:
            self._drop(finished)

    def close(self) -> None:
        self.rows, self.cache, self.draft_cache, self.groups = [], [], None, []
        self.in_flight, self.settled = None, []
