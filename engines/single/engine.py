"""The speculative engine: serves one sequence, exactly, as fast as drafting allows.

Each step is one of:
  * prefill: one chunk of the prompt (all but its last token);
  * verify: a drafter proposes d1..dk, one target forward scores [last, d1..dk],
    `acceptance` decides how many drafts survive and which token follows them;
  * plain: one target forward over [last] (k = 0). Consecutive plain steps are
    pipelined like `mlx_lm.generate_step`: the next forward is queued before the
    current token is read, so gated-off speculation costs nothing.
Which of these a step is, and how far it drafts, is `single_stream_policy`'s call
within the request's `draft_limits`; this module runs the step and keeps the cache.

Invariant after every step: the target cache holds exactly the committed tokens
except the newest one (`last`), which is the input of the next forward -- or, when
a plain token is in flight, the cache also holds `last` and the in-flight token is
sampled but not yet committed. `settle` commits it; `hand_over` settles and hands the
state over. The operations are `engines.interface.Engine`'s.
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache

from engines.cache.rollback import (
    can_trim,
    capturing_inputs,
    detached_copy,
    roll_back,
    take_snapshot,
    trim_exact,
)
from engines.drafting.draft import DRAFT, PLD, Draft, ModelDrafter
from engines.drafting.draft_model import DraftState
from engines.drafting.draft_vocab import describe_vocabulary, vocabulary_of
from engines.drafting.entries import drafter_entry
from engines.drafting.mtp import MTPState
from engines.gating.measured_costs import PLAIN, CostModel
from engines.interface import StepResult, starting_state
from engines.model.registry import ModelRegistry
from engines.prefill_pacing import PrefillPacer
from engines.prompt_images import advance_towers, chunk_embeddings, whole_images
from engines.request import at_checkpoint, next_checkpoint
from engines.sample.acceptance import accept_greedy
from engines.sample.logprobs import token_logprob, token_logprobs
from engines.sample.sampling import coupled_tokens, sample_token
from engines.sample.verify import accept_sampled_draft, processed_logits
from engines.sequence import FinishReason, Sequence, StepOutput
from engines.single.active import Active
from engines.single.policy import SingleStreamPolicy
from engines.spec_config import SpecConfig
from engines.speculation import Speculation, build_speculation
from engines.state import SequenceState, resume_drafter

log = logging.getLogger(__name__)


class SpeculativeEngine:
    name = "speculative"

    def __init__(
        self,
        registry: ModelRegistry,
        config: SpecConfig | None = None,
        cost: CostModel | None = None,
        speculation: Speculation | None = None,
    ) -> None:
        """Serves with `speculation` (the model's setup, shared with the batched
        engine), or one built here from `config` and `cost` (tests, benchmarks)."""
        self.registry = registry
        self.model = registry.model_for(self.name)
        self.speculation = speculation or build_speculation(registry, config, cost)
        spec = self.speculation  # read through these names: the setup's own objects
        self.config, self.totals, self.limits = spec.config, spec.totals, spec.limits
        self.costs, self.realized, self.confidence = spec.costs, spec.realized, spec.confidence
        self.drafter: ModelDrafter | None = spec.drafter
        # the target's forwards that also yield what the drafter is fed (its features)
        self.target_parts = spec.setup.features if spec.setup else None
        self.vocab_size = spec.vocab_size
        self.pacer = PrefillPacer(self.config.prefill_step_size)  # prompt chunks sized by time
        self.policy = SingleStreamPolicy(
            self.limits, self.costs, self.realized, self.drafter, self.confidence
        )
        self.active: Active | None = None
        self.checkpoint_prompts = False  # keep prompt checkpoints (there is a prefix cache)
        # what the calls since the last result produced (finished caches, checkpoints):
        # returned by the next `step`, `settle` or `hand_over`
        self._result = StepResult()

    def describe(self) -> str:
        methods = (["pld"] if self.config.enable_pld else []) + (
            [self.drafter.method] if self.drafter else []
        )
        cost = self.costs.model()
        costs = ", ".join(f"{c:.2f}" for c in cost.verify[: self.config.num_draft_tokens + 1])
        draft_model = getattr(self.drafter, "model", None)
        scores = (
            f", scores {describe_vocabulary(draft_model)}" if vocabulary_of(draft_model) else ""
        )
        return (
            f"methods={'+'.join(methods) or 'none'} k={self.config.num_draft_tokens} "
            + (f"({self.drafter.method}: stops when unsure{scores}) " if self.drafter else "")
            + (f"(prompt lookup up to {self.limits.pld_cap}) " if self.config.enable_pld else "")
            + f"verify cost vs plain step for 1..k+1 tokens=[{costs}]"
            + (f" draft step={cost.draft_step:.2f}" if self.drafter else "")
        )

    # ---- admission and hand-over ------------------------------------------------

    @property
    def has_capacity(self) -> bool:
        return self.active is None

    @property
    def active_ids(self) -> list[str]:
        return [self.active.seq.request_id] if self.active else []

    def admit(self, start: Sequence | SequenceState) -> None:
        """A new request starts: from an empty cache, or a cached prefix of its prompt."""
        self.take_over(starting_state(start, self.model))

    def take_over(self, state: SequenceState) -> None:
        """Continue a sequence from handed-over state, without re-prefilling its cache."""
        assert self.active is None, "the speculative engine serves one sequence at a time"
        seq = state.seq
        state = resume_drafter(state, getattr(self.drafter, "entry_ahead", None))
        drafting = state.drafting  # the request's own, kept as the same object
        drafting.fill(self.limits, seq)
        drafting.draft = drafting.draft or DraftState()
        drafting.mtp = drafting.mtp or MTPState()
        active = Active(seq, state.cache, state.cached, seq.processors, drafting)
        if active.processors:
            active.history = mx.array(active.tokens[: state.cached], dtype=mx.int32)
        self.active = active

    def settle(self) -> StepResult:
        """Commit a plain token still in flight (its output is in the result), so the
        cache holds exactly the committed tokens but the newest again."""
        active = self.active
        outputs = []
        try:
            if active is not None and active.in_flight is not None:
                outputs = self._commit_in_flight(pipeline=False)
        except Exception as exc:  # noqa: BLE001 - a failing commit fails its request only
            log.exception("request %s failed while being handed over", active.seq.request_id)
            active.seq.finish_reason = FinishReason.ERROR
            error = StepOutput(active.seq.request_id, [], "", FinishReason.ERROR, error=str(exc))
            outputs = [error]
            self.active = None
        return self._take(outputs)

    def hand_over(self, request_id: str) -> tuple[SequenceState | None, StepResult]:
        """Hand the sequence over at a step boundary, a plain token in flight committed
        first (`settle`); None for the state when that commit finished it."""
        active = self.active
        assert active is not None and active.seq.request_id == request_id, "not served here"
        result = self.settle()
        self.active = None
        if active.seq.finished:
            return None, result
        active.drafting.mtp.target_cache = None  # the next engine sets what it reads
        return SequenceState(active.seq, active.cache, active.cached, active.drafting), result

    def _take(self, outputs: list[StepOutput]) -> StepResult:
        """The result of this call: `outputs` and what the engine kept since the last."""
        result, self._result = self._result, StepResult()
        result.outputs += outputs
        return result

    def cancel(self, request_id: str, keep: bool = False) -> bool:
        """End the request; with `keep` (a client's cancel, not a failure) the cache of
        what it prefilled and generated goes to the next result's `released`, so a
        retry of the same prompt resumes from it instead of prefilling again."""
        if self.active is None or self.active.seq.request_id != request_id:
            return False
        self.active.seq.finish_reason = FinishReason.CANCELLED
        self._release(keep_cache=keep)
        return True

    def copy_cache(self, request_id: str) -> SequenceState | None:
        """A copy of the decoding sequence's cache of the tokens it holds (a plain step
        in flight included: it holds the newest committed token), and of its draft
        model's, for the prefix cache; the sequence goes on unchanged. None: not here,
        or its prompt is not in yet."""
        active = self.active
        if active is None or active.seq.request_id != request_id:
            return None
        if len(active.tokens) - active.cached > 1:
            return None  # still prefilling: `Sequence.keep_at` copies it where asked
        draft = self._feature_entry(active)
        if active.drafting.draft.cache:  # the prefix cache keeps it if it holds nearly as much
            draft = DraftState(
                detached_copy(active.drafting.draft.cache), list(active.drafting.draft.fed)
            )
        return SequenceState.entry(active.seq, detached_copy(active.cache), active.cached, draft)

    def _feature_entry(self, active: Active) -> DraftState | None:
        """What a prefix-cache entry keeps of a feature drafter (DFlash's context K/V,
        an EAGLE-3 chain's pairs; copies), or None: the drafter keeps nothing there."""
        ahead, state = getattr(self.drafter, "entry_ahead", None), active.drafting.mtp
        if ahead is None or state.cache is None:
            return None
        self.drafter.feed(state)  # its pending positions too: the entry holds them all
        layers = [layer.extract(0) for layer in state.cache]
        return drafter_entry(state, active.tokens, layers, ahead)

    # ---- the step ---------------------------------------------------------------

    def step(self) -> StepResult:
        """One step: a prompt chunk, a verify of a draft, or a plain step (pipelined)."""
        return self._take(self._step())

    def _step(self) -> list[StepOutput]:
        active = self.active
        if active is None:
            return []
        if len(active.tokens) - active.cached > 1:
            self._prefill_chunk(active)
            return []
        started = time.perf_counter()
        if active.in_flight is None:
            draft = self.policy.propose(active, self._drafter_state(active))
            if draft is not None:
                proposed = time.perf_counter()
                # Only steady proposals: a catch-up prefill of the draft (new request,
                # return from batching) is a once-per-request cost like the prompt's
                # prefill, not what a drafting step costs.
                model_state = self._drafter_state(active)
                caught_up = model_state.caught_up if draft.gate == DRAFT else 0
                if draft.gate == DRAFT and caught_up <= 2:
                    drafted = 1 if self.costs.base.block_draft else len(draft.tokens)
                    self.costs.observe_draft(drafted, proposed - started)  # per forward
                outputs = self._verify(active, draft)
                finished = time.perf_counter()
                self.costs.observe_verify(len(draft.tokens) + 1, finished - proposed)
                committed = sum(len(o.token_ids) for o in outputs)
                if draft.method == PLD and PLD in active.drafting.gates:
                    active.drafting.gates[PLD].observe_outcome(finished - started, committed)
                # Every drafting step counts in what drafting gives, less the time it took
                # to catch the draft model up on tokens it had not seen (a prompt, a run
                # of plain steps): a once-per-switch cost, not what drafting steps cost.
                # Steps after a long catch-up left out entirely, a closed gate's probes
                # never counted, and a verdict of "slower" could never be revised.
                if self.realized and draft.gate == DRAFT:
                    seconds = finished - started - model_state.catch_up_seconds
                    self.realized.observe_draft(
                        DRAFT, len(draft.tokens), seconds, committed, active.predicted
                    )
                return outputs
            active.in_flight, active.in_flight_logprobs = self._forward_and_sample(
                active, mx.array(active.tokens[-1:]), len(active.seq.generated)
            )
            active.cached += 1
            return self._commit_in_flight(pipeline=True)
        outputs = self._commit_in_flight(pipeline=True)
        if self.active is not None and self.active.in_flight is not None:
            # Started with a token in flight and queued the next one: a steady pipelined
            # plain step, the cost drafting has to beat. (The last plain step before a
            # draft only reads a token computed long ago; it would look nearly free.)
            seconds = time.perf_counter() - started
            self.costs.observe_plain(seconds)
            if self.realized is not None:
                self.realized.observe(PLAIN, seconds, 1)
        return outputs

    def _prefill_chunk(self, active: Active) -> None:
        """Feed the next chunk of the prompt (ending at a checkpoint if one is due)."""
        end = len(active.tokens) - 1
        if self.checkpoint_prompts:
            end = next_checkpoint(active.seq.request, active.cached, end)
        end = active.seq.prefill_stop(active.cached, end)
        started = time.perf_counter()
        vision = self.registry.target.vision
        stop = min(end, active.cached + self.pacer.next_chunk(False))
        ids = active.tokens[active.cached : whole_images(vision, active.seq, active.cached, stop)]
        rows = [(active.seq, active.cached, ids)]
        if active.seq.request.images and advance_towers(vision, rows):
            # a layer of the vision tower this step: a request that arrives meanwhile
            # is batched at the next step, not after the whole tower
            return
        chunk = mx.array(ids)
        embeddings = chunk_embeddings(vision, rows)
        feeds_mtp = self._feeds_mtp(active)
        if embeddings is not None and not feeds_mtp:
            self.model(chunk[None], cache=active.cache, input_embeddings=embeddings)
            mx.eval([c.state for c in active.cache])
        elif feeds_mtp:
            # the MTP head sees the prompt too: each position's hidden state with the
            # token after it, fed now (not kept: a long prompt's states are large); a
            # chunk with images is fed as embeddings there too
            _, hidden = self._forward(active, chunk, embeddings)
            following = active.tokens[active.cached + 1 : active.cached + 1 + chunk.size]
            active.drafting.mtp.observe(active.cached, hidden[0], mx.array(following))
            self.drafter.feed(active.drafting.mtp)
            mx.eval(
                [c.state for c in active.cache], [c.state for c in active.drafting.mtp.cache or []]
            )
        else:
            self.model(chunk[None], cache=active.cache)
            mx.eval([c.state for c in active.cache])
        if active.processors:
            active.history = mx.concat([active.history, chunk])
        active.cached += chunk.size
        active.seq.prefilled = active.cached
        self.pacer.observe(chunk.size, time.perf_counter() - started, False, decoding=False)
        if self._keeps_checkpoint(active, end):
            copy = detached_copy(active.cache)
            draft = self._feature_entry(active)  # the drafter was fed this chunk too
            self._result.checkpoints.append(
                SequenceState.entry(active.seq, copy, active.cached, draft)
            )
        mx.clear_cache()

    def _keeps_checkpoint(self, active: Active, end: int) -> bool:
        """Whether the caches as they are now become a prefix-cache entry (free: the
        arrays are shared values until the sequence's own updates replace them): a
        prompt, or its checkpoint position, just prefilled into caches that cannot be cut
        back later (recurrent state, a slid window), so the same prompt again -- a retry,
        another choice, a shared system prompt -- starts from here; or a prompt
        position that requests of its key wait for (`Sequence.keep_at`)."""
        seq = active.seq
        if active.cached in seq.keep_at:
            return True
        checkpoint = self.checkpoint_prompts and at_checkpoint(seq.request, active.cached, end)
        return checkpoint and not can_trim_prompt_cache(active.cache)

    def _forward_and_sample(
        self, active: Active, tokens: mx.array, position: int
    ) -> tuple[mx.array, mx.array]:
        """One plain target step on `tokens` (shape (1,)); returns the token sampled for
        output `position` and the log-probabilities it was sampled from (lazy arrays)."""
        logits, hidden = self._forward(active, tokens)
        logits = logits[:, -1, :]
        if active.processors:
            active.history = mx.concat([active.history, tokens])
            for processor in active.processors:
                logits = processor(active.history, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        params, rng = active.seq.request.sampling, active.seq.rng
        token = sample_token(params, logprobs, rng, position)
        if hidden is not None:
            active.drafting.mtp.observe(active.cached, hidden[0], token)
        return token, logprobs

    def _feeds_mtp(self, active: Active) -> bool:
        """The request may draft with the MTP head, so the head must see its tokens."""
        return getattr(self.drafter, "fed_with_target", False) and DRAFT in active.drafting.gates

    def _forward(
        self, active: Active, tokens: mx.array, embeddings: mx.array | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """A target forward over `tokens` (shape (n,)), or over `embeddings` (1, n, D)
        where given (a prompt chunk with images): logits (1, n, V), and the hidden
        states before the LM head when the MTP head will need them (else None)."""
        if not self._feeds_mtp(active):
            return self.model(tokens[None], cache=active.cache), None
        self.model.guard(tokens)
        return self.target_parts.forward(tokens[None], active.cache, embeddings)

    def _drafter_state(self, active: Active) -> DraftState | MTPState:
        if getattr(self.drafter, "fed_with_target", False):
            active.drafting.mtp.target_cache = active.cache  # what an assistant drafter reads
            return active.drafting.mtp
        return active.drafting.draft

    def _commit_in_flight(self, pipeline: bool) -> list[StepOutput]:
        active = self.active
        seq = active.seq
        current, current_logprobs = active.in_flight, active.in_flight_logprobs
        active.in_flight = active.in_flight_logprobs = None
        tokens_left = seq.request.max_tokens - len(seq.generated) - 1
        if pipeline and tokens_left > 0 and self._next_step_is_plain(active):
            # `current` is the token at output position len(generated); this samples the next.
            active.in_flight, active.in_flight_logprobs = self._forward_and_sample(
                active, current, len(seq.generated) + 1
            )
            mx.async_eval(active.in_flight)
            active.cached += 1
        for gate in active.drafting.gates.values():
            gate.plain_token()
        active.forced_plain = max(0, active.forced_plain - 1)
        token = current.item()
        output = StepOutput(seq.request_id, [token], seq.commit(token))
        if seq.request.logprobs is not None:
            output.logprobs = [token_logprob(current_logprobs[0], token, seq.request.logprobs)]
        return self._finish_step(output)

    def _next_step_is_plain(self, active: Active) -> bool:
        return active.forced_plain > 0 or not any(
            gate.due for gate in active.drafting.gates.values()
        )

    # ---- drafting and verification ---------------------------------------------

    def _verify(self, active: Active, draft: Draft) -> list[StepOutput]:
        seq = active.seq
        params = seq.request.sampling
        k = len(draft.tokens)
        fed = [active.tokens[-1], *draft.tokens]
        snapshot = take_snapshot(active.cache)  # None unless the cache cannot trim
        with capturing_inputs(self.registry.target.model, active.cache, snapshot):
            logits, hidden = self._forward(active, mx.array(fed))
        logits = logits[0]
        logits = processed_logits(logits, active.history, fed, active.processors)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if params.greedy or seq.rng.seeded:
            # Greedy: the argmax. Seeded: each position's plain seeded sample (coupled
            # with the draft's draws), so the tokens are those of plain decoding.
            target = (
                mx.argmax(logprobs, axis=-1)
                if params.greedy
                else coupled_tokens(params, logprobs, seq.rng, len(seq.generated))
            ).tolist()
            accepted = accept_greedy(target, draft.tokens)
            next_token = target[accepted]
        else:
            accepted, next_token = accept_sampled_draft(
                params, seq.rng, logprobs, draft.tokens, draft.probs
            )
            accepted, next_token = int(accepted.item()), int(next_token.item())
        roll_back(active.cache, k - accepted, snapshot, self.model, fed[: 1 + accepted])
        if hidden is not None:  # the accepted positions' states, each with its next token
            following = mx.array([*draft.tokens[:accepted], next_token])
            active.drafting.mtp.observe(active.cached, hidden[0, : 1 + accepted], following)
        active.cached += 1 + accepted
        if active.processors:
            active.history = mx.concat([active.history, mx.array(fed[: 1 + accepted])])
        self.policy.record(active, draft, accepted)
        committed = [*draft.tokens[:accepted], next_token]
        text = []
        for token in committed:
            text.append(seq.commit(token))
            if seq.finished:
                break
        output = StepOutput(seq.request_id, committed[: len(text)], "".join(text))
        if seq.request.logprobs is not None:
            n = len(output.token_ids)
            output.logprobs = token_logprobs(logprobs[:n], output.token_ids, seq.request.logprobs)
        return self._finish_step(output)

    def _finish_step(self, output: StepOutput) -> list[StepOutput]:
        seq = self.active.seq
        output.finish_reason, output.matched_stop = seq.finish_reason, seq.matched_stop
        if seq.finished:
            self._release(keep_cache=True)
        elif len(seq.generated) % 256 < len(output.token_ids):
            mx.clear_cache()
        return [output]

    def _release(self, keep_cache: bool = False) -> None:
        """Drop the active sequence; a finished one leaves its cache in the result's
        `released`, trimmed to the committed tokens it holds (a stop can end a run
        early). A pipelined token still in flight is not committed, and the cache
        already holds every committed token (the newest was fed to compute it): that
        cache is kept as it is."""
        active, self.active = self.active, None
        if not keep_cache:
            return
        committed = len(active.tokens)
        if active.cached > committed:
            if not can_trim(active.cache, active.cached - committed):
                return  # recurrent or windowed: it cannot be cut back to reuse
            trim_exact(active.cache, active.cached - committed)
            active.cached = committed
        draft = self._feature_entry(active) or active.drafting.draft
        self._result.released.append(
            SequenceState.entry(active.seq, active.cache, active.cached, draft)
        )
