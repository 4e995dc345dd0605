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
move in and out with their caches (`membership`: `take_over` / `hand_over`, which settles
a step in flight first), so migration never re-prefills. Which kind each step is, is
decided in one place (`step_plan`); the operations are `engines.interface.Engine`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engines.batched.containment import contain_draft_failure, failed_outputs, involved
from engines.batched.costs import BatchCosts, BatchPlan
from engines.batched.drafting import BatchRow, plan_rows
from engines.batched.membership import BatchMembership
from engines.batched.mtp import BatchedMTP
from engines.batched.packed_forward import ChunkFeed, supports_packing
from engines.batched.pipeline import Cadence, InFlight, queue_plain
from engines.batched.prefill_groups import Checkpoints, PrefillGroup, prefill_next
from engines.batched.row_drafters import rows_drafter
from engines.batched.step_plan import StepKind, plan_step
from engines.batched.verify import accept_rows, commit_row, process_rows
from engines.cache.ragged_cache import RaggedKVCache
from engines.cache.ragged_recurrent import is_recurrent
from engines.cache.rollback import capturing_inputs, restore_rows, roll_back_rows, take_snapshot
from engines.drafting.draft import DRAFT, LOOKUPS, MODEL_DRAFTERS
from engines.faults import check
from engines.interface import StepResult
from engines.model.registry import ModelRegistry
from engines.prefill_pacing import PrefillPacer
from engines.sequence import StepOutput
from engines.spec_config import SpecConfig
from engines.speculation import Speculation

log = logging.getLogger(__name__)


class BatchedSpeculativeEngine(BatchMembership):
    """Owned by the engine thread: every field is read and changed there only. Rows
    in and out are `BatchMembership`'s; the step is here."""

    name = "batched"

    def __init__(
        self,
        registry: ModelRegistry,
        speculation: Speculation,
        prefill_step_size: int = 512,
        costs: BatchCosts | None = None,
    ) -> None:
        self.registry = registry
        self.model = registry.model_for(self.name)
        # a hybrid's recurrent rows cannot be cut back when a finished row leaves
        self.recurrent = any(is_recurrent(c) for c in make_prompt_cache(registry.target.model))
        self.model_drafter = rows_drafter(
            speculation.setup, registry, self.model, prefill_step_size
        )
        # the MTP head needs the hidden states of every target forward of the batch
        self.mtp = self.model_drafter if isinstance(self.model_drafter, BatchedMTP) else None
        if self.mtp is not None:
            self.model = self.mtp.target  # the same ops and logits, run in two parts
        self.speculation = speculation  # the model's setup, shared with the single stream
        self.config: SpecConfig = speculation.config
        self.limits = speculation.limits  # a migrating request keeps its limits
        self.costs = costs or BatchCosts(speculation.costs.model(), learn=speculation.costs.learn)
        self.prefill_step_size = prefill_step_size
        self.contain = registry.lockstep is None  # a failure stays with its rows (`containment`)
        self.rows: list[BatchRow] = []
        self.cache: list[RaggedKVCache] = []
        self.draft_cache: list[RaggedKVCache] | None = None
        self.groups: list[PrefillGroup] = []
        self.checkpoint_prompts = False  # keep prompt checkpoints (there is a prefix cache)
        self.in_flight: InFlight | None = None  # a plain step queued ahead (`batched_pipeline`)
        self._last = StepKind.IDLE  # the kind of the previous step (`step_plan`)
        # what the calls since the last result produced (outputs of a settle on the way
        # in, finished caches, checkpoints, step sizes, model time): returned by the
        # next `step`, `settle` or `hand_over`
        self._result = StepResult()
        self.cadence = Cadence()  # host time between steps, plain steps as served
        self.pacer = PrefillPacer(prefill_step_size)  # chunk sizes beside decoding rows
        # a prefill chunk rides in the rows' verify forward (`packed_forward`)
        self.packing = (
            self.mtp is None
            and registry.lockstep is None
            and not self.recurrent
            and supports_packing(self.model)
        )

    # ---- the step ---------------------------------------------------------------------

    def step(self) -> StepResult:
        """One step (`_step`), and the host time since the last one returned: what the
        caller did in between (publishing that step's outputs), which a pipelined plain
        step overlaps with its forward and a drafting step waits for."""
        self.cadence.begin_step(time.perf_counter())
        self._result.forward_seconds, self._result.step_sizes = 0.0, []
        outputs = self._step()
        if self.rows:
            self.cadence.returned_at = time.perf_counter()
        return self._take(outputs)

    def _step(self) -> list[StepOutput]:
        """The step `step_plan` picks, run."""
        started = time.perf_counter()
        plan = plan_step(
            self.in_flight,
            bool(self.groups),
            self.rows,
            self._last,
            self._plan,
            self.costs.plain_probe_due,  # a plain step to measure, not a run
            # a chunk rides in the rows' forward once a step without one is measured:
            # the pacer sizes it by that step (unmeasured, it would keep its first size)
            carry=self.packing and self.pacer.decode_seconds is not None,
        )
        self._last = plan.kind
        if plan.kind == StepKind.COMMIT:
            return self._commit_in_flight(queue_next=plan.queue_next)
        if plan.kind == StepKind.PREFILL:
            return self._prefill_chunk()
        if plan.kind == StepKind.PIPELINE:
            return self._start_pipeline()
        if plan.kind == StepKind.VERIFY and plan.carry:
            return self._carrying_step(plan.batch, started)
        if plan.kind == StepKind.VERIFY:
            return self._drafting_step(plan.batch, started, len(self.rows))
        return []

    def settle(self) -> StepResult:
        """Commit a plain step still in flight, so every row holds all its committed
        tokens but the newest again (before a row leaves: a migration, a pause); the
        result has its outputs and what the engine kept since the last result."""
        return self._take(self._settle_in_flight())

    def _take(self, outputs: list[StepOutput]) -> StepResult:
        """The result of this call: what the engine kept since the last, and `outputs`."""
        result, self._result = self._result, StepResult()
        result.outputs += outputs
        return result

    def _settle_in_flight(self) -> list[StepOutput]:
        return self._commit_in_flight(queue_next=False) if self.in_flight is not None else []

    def _start_pipeline(self) -> list[StepOutput]:
        """Queue this plain step, then hand over to `_commit_in_flight`, which queues
        the next one before reading this one."""
        started = time.perf_counter()
        inputs = mx.array([row.tokens[-1] for row in self.rows])
        self._queue_plain(inputs, ahead=0)
        self._result.forward_seconds += time.perf_counter() - started
        self.cadence.pipelined_at = None  # two steps queued at once: the first is no cadence
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
        self._result.forward_seconds += time.perf_counter() - started
        held = 0 if queue_next else 1  # tokens a row's cache lacks after the commit
        outputs, finished = [], []
        for i, (row, token) in enumerate(zip(self.rows, tokens, strict=True)):
            for gate in row.drafting.gates.values():
                gate.plain_token()
            self._result.step_sizes.append((current.width, 0))
            output = commit_row(row, [token], current.logprobs[i : i + 1])
            if output.finish_reason is not None:
                finished.append(i)
            else:
                assert self.cache[0].held[i] == len(row.tokens) - held, "row out of step"
            outputs.append(output)
        self._release(finished)
        self._observe_plain_cadence(current.width, len(outputs), queue_next)
        if queue_next and self.rows:  # the step after the one in flight: plain again?
            self.in_flight.plain_after = self._plan().k == 0
        return outputs

    def _queue_plain(self, inputs: mx.array, ahead: int) -> None:
        """Queue a plain step; the MTP head gets each row's pair (lazily) at once."""
        before = list(self.cache[0].held)
        self.in_flight = queue_plain(self.model, self.cache, self.rows, inputs, ahead)
        if self.mtp is not None:
            tokens = self.in_flight.tokens
            self.mtp.observe(self.rows, before, [tokens[i : i + 1] for i in range(len(self.rows))])

    def _observe_plain_cadence(self, rows: int, committed: int, queued: bool) -> None:
        """A plain step's cost as served (`Cadence.plain_step`), for the batch costs."""
        seconds = self.cadence.plain_step(time.perf_counter(), queued)
        if seconds is not None:
            self.pacer.observe_decode(seconds)
            self.costs.observe_target(rows, seconds)
            self.costs.observe_outcome(rows, self.costs.plain_plan(rows), committed, seconds)

    def _drafting_step(
        self, plan: BatchPlan, started: float, rows: int, forward: Callable | None = None
    ) -> list[StepOutput]:
        """A verify of the plan's drafts (or an unpipelined plain step), timed; a
        `forward` that carries a prefill chunk, or a draft that failed, makes it a step
        that measures nothing."""
        k, measured = plan.k, forward is None
        if plan.with_model and not self._draft():  # the lookup drafts are verified alone
            k, measured = min(k, max(len(row.drafts) for row in self.rows)), False
        outputs = self._verify(k, forward)
        if not measured:
            return outputs
        committed = sum(len(output.token_ids) for output in outputs)
        # judged like a plain step's cadence (from the previous step's return, so the
        # caller's host work counts), or drafting that loses as served would look cheap
        seconds = time.perf_counter() - started + self.cadence.host_seconds
        self.costs.observe_outcome(rows, plan, committed, seconds)
        self.pacer.observe_decode(seconds)
        return outputs

    def _draft(self) -> bool:
        """The model drafter drafts for the rows that chose it (timed). False: it raised,
        and no row keeps a model draft (`containment.contain_draft_failure`)."""
        started = time.perf_counter()
        try:
            forwards, steady = self.model_drafter.draft(self.draft_cache, self.rows, self.cache)
        except Exception as exc:  # noqa: BLE001 - a draft only proposes: every row goes on
            contain_draft_failure(self.model_drafter, self.draft_cache, self.rows, exc)
            return False
        finally:
            seconds = time.perf_counter() - started
            self._result.forward_seconds += seconds
        if steady and forwards:  # a long catch-up is not what each drafted token costs
            self.costs.observe_draft(len(self.rows), seconds / forwards)
        return True

    def _carrying_step(self, plan: BatchPlan, started: float) -> list[StepOutput]:
        """The rows' verify (as `plan` drafts it) with one chunk of the next prefill
        group packed into its forward: the rows wait for one forward a little wider than
        their own, not for a chunk and then their step. The chunk's size keeps that
        forward within the pacer's budget."""
        carried: list = []  # what the prefill returned: (joining rows, outputs)
        feed = ChunkFeed()

        def forward(inputs: mx.array) -> mx.array:
            began, lengths = time.perf_counter(), list(self.cache[0].held)
            feed.inputs, feed.cache = inputs, self.cache
            carried.append(self._prefill_next(feed, decoding=True))
            self._result.forward_seconds += time.perf_counter() - began
            if feed.logits is not None:
                return feed.logits
            for layer in self.cache:  # the chunk failed before or in its forward
                layer.set_lengths(lengths)
            return self.model(inputs, cache=self.cache)

        outputs = self._drafting_step(plan, started, len(self.rows), forward)
        if feed.logits is not None:
            self.pacer.observe(feed.tokens, time.perf_counter() - started, packed=True)
        if not carried:  # the verify failed before its forward
            return outputs
        joining, prefilled = carried[0]
        return prefilled + outputs + self._join_prefilled(joining, prefilled)

    def _prefill_chunk(self) -> list[StepOutput]:
        """One chunk of every prompt in a group (`_next_group`; target and draft caches).
        A row whose cache then holds all but its newest token gets its next token from
        one small forward of the group (not a verify of the whole batch, so time to
        first token is the prefill plus one token) and joins the batch."""
        started = time.perf_counter()
        feed, decoding = ChunkFeed(), bool(self.rows)
        try:
            joining, outputs = self._prefill_next(feed, decoding)
        finally:
            seconds = time.perf_counter() - started
            self._result.forward_seconds += seconds
        self.pacer.observe(feed.tokens, seconds, packed=False, decoding=decoding)
        return outputs + self._join_prefilled(joining, outputs)

    def _prefill_next(self, feed: ChunkFeed, decoding: bool):
        """One chunk of the next prefill group, of the pacer's size for whether rows
        decode, fed through `feed` (`prefill_next`: the joining rows and outputs)."""
        checkpoints = Checkpoints(self._result.checkpoints, self.checkpoint_prompts)
        chunk = self.pacer.next_chunk(decoding)
        return prefill_next(
            self.groups,
            self.model,
            self.model_drafter,
            self.mtp,
            chunk,
            checkpoints,
            self.contain,
            feed,
            self.registry.target.vision,
        )

    def _join_prefilled(self, joining, outputs: list[StepOutput]) -> list[StepOutput]:
        """Rows whose prompts are in (`prefill_next`'s `joining`, None: none) join the
        batch; those its `outputs` finished leave it again. Returns failures joining."""
        if joining is None:
            return []
        joined, (rows, cache, draft) = len(self.rows), joining
        try:
            self._merge(rows, cache, draft)
        except Exception as exc:  # noqa: BLE001 - the joining rows fail, the batch goes on
            if not self.contain:
                raise
            return failed_outputs(rows, exc, "joining the batch")
        done = {o.request_id for o in outputs if o.finish_reason is not None}
        self._release(
            [i for i in range(joined, len(self.rows)) if self.rows[i].seq.request_id in done]
        )
        return []

    # ---- planning -----------------------------------------------------------------------

    def _plan(self) -> BatchPlan:
        """Each row's PLD proposal and drafting options; the step's plan."""
        drafter = self.model_drafter.method if self.model_drafter else None
        return plan_rows(self.rows, self.costs, self._row_cap, drafter)

    def _row_cap(self, row: BatchRow, method: str) -> int:
        """The longest draft `method` may propose for the row: the single-stream rule,
        with lookup held to the draft model's cap (one row's long lookup draft would pad
        every row's verify)."""
        if not row.drafting.gates:
            return 0
        gate = row.drafting.gates.get(DRAFT)
        if method == DRAFT and gate and not gate.due and self.limits.drafter_distrusted():
            return 0  # a drafter the server's life rejected waits out the row's cooldown
        seq = row.seq
        k = min(self.limits.request_k(seq, method), self.limits.k_cap)
        return max(0, min(k, seq.request.max_tokens - len(seq.generated) - 1))

    # ---- verification -----------------------------------------------------------------

    def _verify(self, k: int, forward: Callable | None = None) -> list[StepOutput]:
        started = time.perf_counter()
        width = 1 + k
        fed_rows = [[row.tokens[-1], *row.drafts[:k]] for row in self.rows]
        lengths = list(self.cache[0].held)
        inputs = mx.array([fed + [0] * (width - len(fed)) for fed in fed_rows])
        snapshot = take_snapshot(self.cache)  # None unless rows hold recurrent state
        try:
            with capturing_inputs(self.registry.target.model, self.cache, snapshot):
                if forward is None:
                    logits = self.model(inputs, cache=self.cache)
                else:  # the rows' forward and a prefill chunk, packed
                    logits = forward(inputs)
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
        if forward is None:  # a packed forward's time is not the rows' alone
            self.costs.observe_target(len(self.rows) * width, time.perf_counter() - started)
            self._result.forward_seconds += time.perf_counter() - started
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
                for gate in row.drafting.gates.values():
                    gate.plain_token()
            self._result.step_sizes.append((len(self.rows), drafted))
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
        self.limits.totals.record(row.method, drafted, accepted)  # the server's life, both engines
        method = DRAFT if row.method in MODEL_DRAFTERS else row.method  # one model drafter gate
        gate = row.drafting.gates[method]
        k_max = self._row_cap(row, method) or drafted
        match = row.match if row.method in LOOKUPS else 0
        if gate.record(drafted, accepted, k_max, self.costs.prior, match=match):
            row.seq.spec.trip("runtime")
            self.limits.totals.trip("runtime")

    def close(self) -> None:
        self.rows, self.cache, self.draft_cache, self.groups = [], [], None, []
        self.in_flight, self._result = None, StepResult()
