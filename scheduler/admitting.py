"""Admission and migration: which engine owns the model this step, and which waiting
requests start (a mixin of `Scheduler`, run on the engine thread).

Each iteration the mode policy picks the engine for the number of active requests;
if it changes, the in-flight requests move with their KV caches (`EnginePair.switch`).
Then waiting requests start: from the longest cached prefix of their prompts
(`PrefixReuse`), where they were paused or preempted, or -- asking for their prompt's
logprobs -- scored a chunk per iteration first (`ScoringQueue`). One whose prefix is
still being prefilled for another request of its key waits for that (`PrefillFollowers`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from itertools import islice
from typing import TYPE_CHECKING

from engines.faults import arm
from engines.sample.prompt_scoring import PromptScorer
from engines.sequence import FinishReason, make_sequence
from engines.state import SequenceState
from scheduler.policy import Mode
from scheduler.scoring import scoring_budget
from scheduler.throughput import serial_wait_fits
from scheduler.tracking import TrackedRequest

if TYPE_CHECKING:
    from scheduler.config import SchedulerConfig
    from scheduler.engine_pair import EnginePair
    from scheduler.policy import ModePolicy
    from scheduler.prefill_followers import PrefillFollowers
    from scheduler.prefix_reuse import PrefixReuse
    from scheduler.requests import RequestTable
    from scheduler.scoring import ScoringQueue
    from scheduler.throughput import ThroughputModel

log = logging.getLogger(__name__)


class Admitting:
    """The scheduler's admission and mode switches. It keeps no state of its own: what
    it reads and changes -- the request table, the engines, the scoring queue, the
    policy, the prefix reuse and prefill followers, `_last_step` -- belongs to the engine thread."""

    config: SchedulerConfig
    requests: RequestTable
    engines: EnginePair
    throughput: ThroughputModel
    _policy: ModePolicy
    _reuse: PrefixReuse
    _followers: PrefillFollowers
    _scoring: ScoringQueue

    def _schedule(self) -> None:
        """Pick the mode for this step, migrate at the boundary, then admit."""
        admissible = self._admissible()
        running = self.requests.running
        active = len(running) + admissible
        target = self._policy.choose(self.mode, active, idle=not running)
        if target != self.mode:
            self._switch(target)
            self._last_step = None
        engine = self._engine()
        waiting = self.requests.waiting
        ready = self._prefix_ready
        for _ in range(admissible):
            if self.mode == Mode.SPECULATIVE and not engine.has_capacity:
                break
            tracked = waiting.first(ready)
            if tracked is None:
                break  # the rest wait for their prefixes: from disk, or being prefilled
            if not self._kv_admits(tracked):
                break  # it waits for room in the KV budget
            self._start(waiting.take(tracked), engine)
            self._last_step = None  # the next step prefills: not a decode-rate sample

    def _prefix_ready(self, tracked: TrackedRequest) -> bool:
        """Not waiting for its prefix: neither for its file to be read
        (`PrefixReuse.waits_for_disk`) nor for another request's prefill of it
        (`PrefillFollowers.waits`)."""
        if self._waits_for_prefill(tracked):
            return False
        return not self._reuse.waits_for_disk(tracked)

    def _waits_for_prefill(self, tracked: TrackedRequest) -> bool:
        return self._followers.waits(tracked, self.requests, time.monotonic())

    def _copy_prefill(self, leader: TrackedRequest) -> bool:
        """Copy a decoding request's cache into its key's prefix cache now: a request of
        its key sharing its prompt starts from the copy (cut back to what they share)
        instead of prefilling it again; False where the engine hands none out."""
        engine = self._engine()
        state = engine.copy_cache(leader.request.request_id) if engine is not None else None
        if state is None:
            return False
        self._reuse.keep([], [state])
        return True

    def _admissible(self) -> int:
        """How many waiting requests to admit now: all that fit, unless they should
        wait for the running work to finish speculatively (`spec_wait_budget`). Those
        waiting for another's prefill do not count: they must not switch the mode (and
        move that prefill to the batched engine) before they can start."""
        running, waiting = self.requests.running, self.requests.waiting
        followers = sum(1 for tracked in waiting if self._waits_for_prefill(tracked))
        free = min(len(waiting) - followers, self.config.max_num_seqs - len(running))
        if free > 1 or (free and running):
            if self._serial_wait_fits(free):
                return 0 if running else 1
        return free

    def _serial_wait_fits(self, free: int) -> bool:
        budget = self.config.spec_wait_budget
        running = self.requests.running
        if budget <= 0 or not self.throughput.serial_is_faster(len(running) + free):
            return False
        left = sum(max(0, t.request.max_tokens - t.completion_tokens) for t in running.values())
        waiters = [(t.arrived, t.request.max_tokens) for t in islice(self.requests.waiting, free)]
        if not running:  # the first waiter starts now; the others queue behind it
            left, waiters = waiters[0][1], waiters[1:]
        rate = self.throughput.speculative.rate
        return serial_wait_fits(budget, time.monotonic(), left, waiters, rate)

    def _start(self, tracked: TrackedRequest, engine) -> None:
        """Start a request in `engine`, from the longest cached prefix of its prompt."""
        if tracked.parked is not None:
            self._resume(tracked, engine)
            return
        tracked.admitted = time.monotonic()
        prompt = list(tracked.request.prompt_tokens)
        request_id = tracked.request.request_id
        try:
            factory = self.config.logits_processor_factory
            extra = list(factory(tracked.request)) if factory else []
            if tracked.request.constraint is not None:
                grammar = self.model_info.grammar
                extra.append(grammar.processor(tracked.request.constraint, len(prompt)))
            tracked.seq = make_sequence(tracked.request, self.registry.tokenizer, extra)
            tracked.seq.suffix = self.suffix.reader(tracked.request.cache_scope)  # its key's only
            # positions followers wait for: the same set, so those added later reach it too
            tracked.seq.keep_at = tracked.keep_at
            marker = self.config.fault_marker  # a test hook (`engines.faults`)
            arm(tracked.seq, marker, self.registry.tokenizer.decode(prompt) if marker else "")
            if tracked.request.prompt_logprobs is not None:
                # Scored a chunk per iteration (`_score_step`), then it joins the engine.
                top = tracked.request.prompt_logprobs
                self._scoring.add(request_id, PromptScorer(engine.model, prompt, top))
                self.requests.running[request_id] = tracked
                return
            state = self._reuse.start(tracked.seq, self.registry.target.model)
            tracked.cached_tokens = tracked.seq.prefilled = state.cached
            engine.admit(state)
            tracked.modes.append(self.mode.value)
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the loop
            log.exception("request %s could not start", request_id)
            self._finish(tracked, FinishReason.ERROR, error=str(exc))
            return
        self.requests.running[request_id] = tracked

    def _resume(self, tracked: TrackedRequest, engine) -> None:
        """A paused request goes back into the engine where it stopped."""
        state, tracked.parked, tracked.paused_at = tracked.parked, None, None
        if not self._admitted(tracked, engine.take_over, state):
            return
        self.requests.running[tracked.request.request_id] = tracked
        self._note_mode(tracked)

    def _note_mode(self, tracked: TrackedRequest) -> None:
        if tracked.modes[-1:] != [self.mode.value]:
            tracked.modes.append(self.mode.value)

    def _score_step(self) -> None:
        """One chunk of prompt scoring after the engine's step; requests whose prompts
        are scored then finish (max_tokens 0) or join the engine at their scored cache."""
        if not self._scoring:
            return
        running = self.requests.running
        job = self._scoring.next_job(running)
        engine = self._engine()
        if job is not None:
            request_id, scorer = job
            others = len(running) > len(self._scoring)
            try:
                scorer.step(engine.model, scoring_budget(self.config, others))
            except Exception as exc:  # noqa: BLE001 - fail this request, keep serving
                log.exception("scoring the prompt of %s failed", request_id)
                self._finish(running.pop(request_id), FinishReason.ERROR, error=str(exc))
            self._last_step = None  # the next step's time includes this chunk
        room = len(self._scoring) if self.mode == Mode.BATCHED else int(engine.has_capacity)
        for request_id, scorer in self._scoring.take_done(room):
            self._admit_scored(running[request_id], scorer, engine)

    def _admit_scored(self, tracked: TrackedRequest, scorer: PromptScorer, engine) -> None:
        tracked.prompt_logprobs = scorer.scored
        if tracked.request.max_tokens == 0:  # scoring only
            del self.requests.running[tracked.request.request_id]
            self._finish(tracked, FinishReason.LENGTH)
            return
        state = SequenceState(tracked.seq, scorer.cache, scorer.cached)
        if self._admitted(tracked, engine.admit, state):
            self._note_mode(tracked)

    def _admitted(
        self, tracked: TrackedRequest, join: Callable[[SequenceState], None], state: SequenceState
    ) -> bool:
        """Put a request's sequence into an engine (`join`: its `admit` or `take_over`);
        if that raises, it alone fails."""
        try:
            join(state)
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the loop
            log.exception("request %s could not join the engine", tracked.request.request_id)
            self.requests.running.pop(tracked.request.request_id, None)
            self._finish(tracked, FinishReason.ERROR, error=str(exc))
            return False
        return True

    def _switch(self, target: Mode) -> None:
        """Hand the model to the other engine (`EnginePair.switch`), carrying in-flight
        requests with their KV caches, between steps on the engine thread."""
        started = time.perf_counter()
        source = self.mode

        def take_over(state: SequenceState) -> bool:
            tracked = self.requests.running[state.seq.request_id]
            return self._admitted(tracked, self.engines.batched.take_over, state)

        migrated = self.engines.switch(target, self._absorb, take_over)
        for tracked in self.requests.running.values():
            self._note_mode(tracked)
        seconds = time.perf_counter() - started
        self.observer.on_mode_switch(source.value, target.value, seconds)
        self.counters.record_switch(source.value, target.value, migrated)
        log.info(
            "mode %s -> %s in %.1f ms (%d request migrated)",
            source.value,
            target.value,
            seconds * 1000,
            migrated,
        )
