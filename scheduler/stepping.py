"""One step of the owning engine, and publishing what it committed (a mixin of
`Scheduler`, run on the engine thread).

The step's outputs become events in the mailbox; finished requests' caches and prompt
checkpoints go to the prefix cache (`PrefixReuse`); its wall time is a decode-rate
sample (`ThroughputModel`), and the batched engine's drafted tokens and model time go
to the observer.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from engines.batched.engine import BatchedSpeculativeEngine
from engines.interface import StepResult
from engines.sequence import FinishReason, StepOutput
from scheduler.observer import log_request
from scheduler.policy import Mode
from scheduler.tracking import TrackedRequest, final_event, token_event

if TYPE_CHECKING:
    from scheduler.counters import SchedulerCounters
    from scheduler.engine_pair import EnginePair
    from scheduler.mailbox import Mailbox
    from scheduler.observer import SchedulerObserver
    from scheduler.prefix_reuse import PrefixReuse
    from scheduler.requests import RequestTable
    from scheduler.throughput import ThroughputModel

log = logging.getLogger(__name__)


class Stepping:
    """The scheduler's step and publishing. It keeps no state of its own: the request
    table, the engines, the counters, the throughput model and `_last_step` belong to
    the engine thread; the mailbox's outbox too."""

    requests: RequestTable
    engines: EnginePair
    counters: SchedulerCounters
    throughput: ThroughputModel
    observer: SchedulerObserver
    _mailbox: Mailbox
    _reuse: PrefixReuse
    _last_step: tuple[tuple[Mode, int], float] | None

    def _step(self) -> None:
        running = self.requests.running
        if not running:
            self._last_step = None
            return
        engine = self._engine()
        batch_size = len(running)
        started = time.perf_counter()
        try:
            result = engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the requests in this step, keep serving
            if self.registry.lockstep is not None:
                # Across ranks a failed step is most likely a lost rank, and any further
                # collective on a broken ring may never return: fail the server.
                raise
            log.exception("engine step failed")
            for request_id in list(running):
                engine.cancel(request_id)
                self._finish(running.pop(request_id), FinishReason.ERROR, error=str(exc))
            self._last_step = None
            return
        tokens = sum(len(o.token_ids) for o in result.outputs)
        self._measure((self.mode, batch_size), tokens)
        if self.mode == Mode.BATCHED:
            self.counters.record_batch(batch_size)
            self.observer.on_batch_step(batch_size)
        self._absorb(result)
        if isinstance(engine, BatchedSpeculativeEngine):
            self._observe_batched_step(result, time.perf_counter() - started)

    def _absorb(self, result: StepResult) -> None:
        """What an engine call produced: its outputs published, finished requests'
        caches and prompt checkpoints kept for prefix reuse."""
        for output in result.outputs:
            self._publish(output)
        self._reuse.keep(result.released, result.checkpoints)

    def _observe_batched_step(self, result: StepResult, seconds: float) -> None:
        """Drafted tokens per row (speculation under load) and the step's split between
        model forwards and everything else on the engine thread."""
        if result.step_sizes:
            drafted = [count for _, count in result.step_sizes]
            self.observer.on_speculation_step(len(drafted), drafted)
        model_s = result.forward_seconds
        self.observer.on_step_time(model_s, seconds - model_s)

    def _measure(self, shape: tuple[Mode, int], tokens: int) -> None:
        """A decode-rate sample: wall time since the previous step of the same shape."""
        now = time.perf_counter()
        if self._last_step is not None and self._last_step[0] == shape:
            mode, batch_size = shape
            seconds = now - self._last_step[1]
            self.throughput.record(mode == Mode.BATCHED, batch_size, tokens, seconds)
        self._last_step = (shape, now)

    def _publish(self, output: StepOutput) -> None:
        tracked = self.requests.running.get(output.request_id)
        if tracked is None:
            return
        now = time.monotonic()
        if output.token_ids:
            if tracked.first_token is None:
                tracked.first_token = now
                self.observer.on_first_token(now - tracked.arrived)
            else:
                self.observer.on_token_gap(now - tracked.last_token)
            tracked.last_token = now
        tracked.completion_tokens += len(output.token_ids)
        self.counters.generated_tokens += len(output.token_ids)
        if output.finish_reason is not None:
            del self.requests.running[output.request_id]
            self._finish(tracked, output.finish_reason, output=output, error=output.error)
            return
        self._mailbox.deliver(
            tracked, token_event(tracked, output.token_ids, output.text, logprobs=output.logprobs)
        )

    def _finish(
        self,
        tracked: TrackedRequest,
        reason: FinishReason,
        output: StepOutput | None = None,
        error: str | None = None,
        error_kind: str | None = None,
    ) -> None:
        self._release_kv(tracked)
        self.suffix.learn(tracked.seq)  # into its key's suffix index
        event, record = final_event(tracked, reason, output, error, error_kind)
        log_request(record)
        self.observer.on_finished(record)
        self._mailbox.deliver(tracked, event)
