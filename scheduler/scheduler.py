"""The async scheduler: one engine thread owns all MLX work; asyncio talks to it.

Threading rule: MLX runs only on `_engine_thread`. The asyncio side puts commands
in `_inbox` under `_wakeup` (a Condition) and receives events through each
request's `RequestStream` via `loop.call_soon_threadsafe`. The engine thread loop
is `_run`: drain the inbox, let the mode policy pick the engine that owns the model
(migrating in-flight requests at this step boundary if it changes), admit waiting
requests, run one step of the owning engine, publish its tokens.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import logging
import threading
import time
from collections import deque
from itertools import islice

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engines.batched.engine import BatchedSpeculativeEngine
from engines.batched.fallback import BatchedEngine
from engines.drafting.draft_vocab import vocabulary_of
from engines.errors import ContextTooLong, InvalidRequest, QueueFull, ServerNotReady
from engines.faults import arm
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, check_token_ids
from engines.sample.prompt_scoring import PromptScorer
from engines.sequence import FinishReason, StepOutput, make_sequence
from engines.single.engine import SpeculativeEngine
from engines.state import SequenceState, SpecConfig
from scheduler.admission import Backpressure, FairQueue, KeyCounts
from scheduler.config import SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.kv_budget import KVBudget, make_budget
from scheduler.loading import ModelInfo, load_model
from scheduler.observer import NullObserver, SchedulerObserver, log_request
from scheduler.pausing import Pausing
from scheduler.policy import Mode, ModePolicy
from scheduler.preemption import Preemption
from scheduler.prefix_cache import ASSISTANT, SYSTEM, USER, PrefixCache
from scheduler.scoring import ScoringQueue, scoring_budget
from scheduler.stream import RequestStream, TokenEvent
from scheduler.suffix_store import SuffixStore
from scheduler.throughput import ThroughputModel, serial_wait_fits
from scheduler.tracking import Command, TrackedRequest, final_event, key_of, token_event

log = logging.getLogger(__name__)

LOST_RANK_GRACE_S = 2.0  # across ranks: time the engine thread gets to fail on its own


class SchedulerState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class Scheduler(Pausing, Preemption):
    def __init__(self, config: SchedulerConfig, observer: SchedulerObserver | None = None) -> None:
        self.config = config
        self.observer: SchedulerObserver = observer or NullObserver()
        self.state = SchedulerState.LOADING
        self.error: str | None = None
        self.model_info: ModelInfo | None = None
        self._checkpoint_prompts = False  # set at load (see `_load`)
        self.registry: ModelRegistry | None = None
        self._inbox: deque[Command] = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self.draining = False  # shutting down: finish what runs, accept nothing new
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._outstanding = 0  # submitted and not yet finished; touched on the loop only
        # Engine-thread state:
        self._outbox: list[tuple[TrackedRequest, TokenEvent]] = []  # this step's events
        self._waiting: FairQueue[TrackedRequest] = FairQueue(key_of)
        self._running: dict[str, TrackedRequest] = {}
        self._paused: dict[str, TrackedRequest] = {}  # out of the engine until their clients read
        self._backpressure = Backpressure(config.max_unread_events, config.unread_timeout)
        self._per_key = KeyCounts(config.per_key_limit)  # touched on the loop only
        self._scoring = ScoringQueue()  # running requests whose prompts are being scored
        self._spec: SpeculativeEngine | None = None
        self._batched: BatchedSpeculativeEngine | BatchedEngine | None = None
        self.speculation_supported = True  # drafting can run (decided at load)
        self.rows_roll_back = True  # caches trim: batched speculation, pauses, migration
        self._mode = Mode.SPECULATIVE
        self._policy = ModePolicy(config.batch_threshold, config.batch_return_steps)
        self._prefix = (
            PrefixCache(config.prefix_cache_entries, config.prefix_cache_bytes)
            if config.prefix_cache_entries > 0
            else None
        )
        self.counters = SchedulerCounters()
        self.suffix = SuffixStore(config.suffix_tokens_per_key, config.suffix_max_keys)
        self.throughput = config.throughput_model or ThroughputModel()
        self._last_step: tuple[tuple[Mode, int], float] | None = None  # shape, end time
        self.memory: dict[str, int] = {}
        self.kv: KVBudget | None = None  # --max-kv-gb, set at load (`preemption`)
        self.measured_rates: dict = {}  # engine-thread snapshot of `throughput`
        self._memory_sampled = 0.0

    # ---- asyncio side -------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the model has loaded (or failed to); True when ready."""
        self._ready.wait(timeout)
        return self.state == SchedulerState.READY

    @property
    def num_outstanding(self) -> int:
        return self._outstanding

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._paused)

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Admit a request and return its event stream (call on the event loop)."""
        if self.state != SchedulerState.READY or self._stopping:
            # The failure's detail is in the log; clients get the state, not the exception.
            raise ServerNotReady(f"server is {self.state.value}")
        if self.draining:
            raise ServerNotReady("server is shutting down")
        self._validate(request)
        if self._outstanding >= self.config.max_queue + self.config.max_num_seqs:
            raise QueueFull(f"{self._outstanding} requests in flight; retry shortly")
        if self._per_key.full(request.cache_scope):
            raise QueueFull(
                f"this API key has {self._per_key.limit} requests in flight, the most one "
                "key may hold; retry shortly"
            )
        loop = asyncio.get_running_loop()
        stream = RequestStream(request.request_id, self.cancel)
        tracked = TrackedRequest(request, stream, loop, arrived=time.monotonic())
        self._outstanding += 1
        self._per_key.add(request.cache_scope)
        self._send(Command("submit", request.request_id, tracked))
        return stream

    def cancel(self, request_id: str) -> None:
        self._send(Command("cancel", request_id))

    def begin_drain(self) -> None:
        """Refuse new requests; the running and waiting ones carry on."""
        self.draining = True

    def abort_all(self, reason: str) -> None:
        """End every request now; each stream ends with an error event (thread-safe)."""
        self._send(Command("abort_all", reason=reason))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; in-flight requests end as cancelled."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self.state = SchedulerState.STOPPED

    def _validate(self, request: GenerationRequest) -> None:
        info = self.model_info
        if not request.prompt_tokens:
            raise InvalidRequest("the prompt is empty")
        if info is not None:
            check_token_ids(request, info.vocab_size)
        if request.max_tokens < (0 if request.prompt_logprobs is not None else 1):
            raise InvalidRequest("max_tokens must be at least 1 (0 only to score the prompt)")
        self._check_kv(request)
        context = info.context_length if info else None
        if context is not None and len(request.prompt_tokens) + request.max_tokens > context:
            raise ContextTooLong(
                f"this model's context is {context} tokens; the prompt has "
                f"{len(request.prompt_tokens)} and max_tokens asks for {request.max_tokens} more"
            )

    def _send(self, command: Command) -> None:
        with self._wakeup:
            self._inbox.append(command)
            self._wakeup.notify()

    def _deliver(self, tracked: TrackedRequest, event: TokenEvent) -> None:
        """Queue an event; `_flush` hands a whole step's events to each event loop in
        one call, so a batch of B streams wakes the loop once per step, not B times."""
        tracked.delivered += 1
        self._outbox.append((tracked, event))

    def _flush(self) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[TrackedRequest, TokenEvent]]] = {}
        for tracked, event in self._outbox:
            by_loop.setdefault(tracked.loop, []).append((tracked, event))
        self._outbox = []
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._put_all, events)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

    def _put_all(self, events: list[tuple[TrackedRequest, TokenEvent]]) -> None:
        for tracked, event in events:
            if event.final:
                self._outstanding -= 1
                self._per_key.remove(tracked.request.cache_scope)
            tracked.stream.put(event)

    # ---- engine thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
            self._stop_followers()
        finally:
            # Work queued with async_eval (a pipelined token of a cancelled request)
            # must finish, and this thread's MLX streams (and their worker threads) be
            # destroyed here, before the thread ends: left to static destruction at
            # interpreter exit they abort the process ("terminate called without an
            # active exception").
            mx.synchronize()
            mx.clear_streams()

    def _rank_lost(self, reason: str) -> None:
        """Across ranks, from the rank watch's thread: a rank's process has ended. The
        engine thread usually fails on its own at its next forward; if it has not
        within LOST_RANK_GRACE_S (it was idle, or MLX left it waiting on the broken
        ring), every request ends here with an error event, /health turns 503, and
        the engine loop is told to stop (a waiting one never returns: it is a daemon)."""
        deadline = time.monotonic() + LOST_RANK_GRACE_S
        while self.state == SchedulerState.READY and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.state != SchedulerState.READY or self._stopping:  # failed, or shutting down
            return
        log.error("%s; the server must be restarted", reason)
        self.error = f"engine failed: {reason}"
        self.state = SchedulerState.FAILED
        with self._wakeup:
            self._stopping = True
            submitted = [c.tracked for c in self._inbox if c.kind == "submit"]
            self._inbox.clear()
            self._wakeup.notify()
        self._end_all(self.error, submitted)
        self._flush()

    def _stop_followers(self) -> None:
        """Across ranks, let the other ranks exit with this one."""
        lockstep = self.registry.lockstep if self.registry is not None else None
        if lockstep is None or self.state == SchedulerState.FAILED:
            return
        try:
            lockstep.stop_followers()
        except RuntimeError:  # a rank is already gone
            log.warning("could not tell every rank to stop", exc_info=True)

    def _serve(self) -> None:
        """Load the model, then step until stopped; every exit path ends all requests."""
        try:
            self._load()
        except Exception as exc:  # noqa: BLE001 - any load failure is reported, not raised
            log.exception("model load failed")
            self.error = f"model load failed: {exc}"
            self.state = SchedulerState.FAILED
            self._ready.set()
            return
        # What loading left (modules, weights' wrappers, ~90k objects) lives as long as
        # the process: out of the collector's reach, a full collection no longer pauses
        # every stream for 100-400 ms.
        gc.freeze()
        self.state = SchedulerState.READY
        self._ready.set()
        try:
            while True:
                commands = self._wait_for_work()
                if commands is None:
                    break
                self._apply(commands)
                self._schedule()
                self._step()
                self._keep_within_budget()
                self._score_step()
                self._flush()
                self._sample_gauges()
        except Exception as exc:  # noqa: BLE001 - the loop itself broke: report, fail all
            log.exception("engine loop failed; the server must be restarted")
            self.error = f"engine failed: {exc}"
            self.state = SchedulerState.FAILED
            self._abort_all(self.error)
            self._flush()
            return
        self._abort_all("server is shutting down")
        self._flush()

    def _sample_gauges(self, every_s: float = 0.5) -> None:
        """MLX memory (read on the engine thread, the only thread that touches MLX) and
        a snapshot of the measured rates, for readers on other threads."""
        now = time.monotonic()
        if now - self._memory_sampled < every_s:
            return
        self._memory_sampled = now
        self.memory = {
            "active": mx.get_active_memory(),
            "cache": mx.get_cache_memory(),
            "peak": mx.get_peak_memory(),
        }
        self.measured_rates = self.throughput.as_dict()

    def _load(self) -> None:
        loaded = load_model(self.config)
        self.registry, self._spec = loaded.registry, loaded.engine
        # prompt checkpoints: only for a prefix cache, only where caches cannot be cut
        # back to any prefix (plain KV needs none, and copying rows out would be waste)
        self._checkpoint_prompts = self._prefix is not None and loaded.info.prompt_checkpoints
        self._spec.checkpoint_prompts = self._checkpoint_prompts
        self.speculation_supported = loaded.speculation_supported
        self.rows_roll_back = loaded.rows_roll_back
        if self.registry.lockstep is not None:
            self.registry.lockstep.watch.start(self._rank_lost)
        if not self.speculation_supported:  # every request is batched
            self._policy = ModePolicy(
                batch_threshold=1, return_steps=self.config.batch_return_steps
            )
        elif not self.rows_roll_back:  # a batched row cannot leave: back only when idle
            self._policy = ModePolicy(
                self.config.batch_threshold, self.config.batch_return_steps, migrate_back=False
            )
        self.model_info = loaded.info
        if self.registry.lockstep is None:  # its profiling forward would run on one rank only
            models = [m.model for m in (self.registry.target, self.registry.draft) if m]
            self.kv = make_budget(self.config.max_kv_bytes, models, mx.get_active_memory())

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def ranks(self) -> int:
        """Processes serving the model: more than 1 with --distributed."""
        lockstep = self.registry.lockstep if self.registry is not None else None
        return lockstep.ranks if lockstep is not None else 1

    @property
    def batched_engine(self) -> BatchedEngine | None:
        """None until two requests were first active at once (lazy start)."""
        return self._batched

    @property
    def speculative_engine(self) -> SpeculativeEngine | None:
        return self._spec

    @property
    def drafters(self) -> list[str]:
        """The drafters requests may use: "pld", "suffix", and "draft" or "mtp" (the model
        drafter)."""
        spec = self._spec
        if spec is None:
            return []
        methods = ["pld"] if spec.config.enable_pld else []
        methods += ["suffix"] if self.suffix.enabled else []  # the key's earlier requests
        return methods + ([spec.drafter.method] if spec.drafter is not None else [])

    @property
    def draft_vocabulary(self) -> dict | None:
        """How much of its vocabulary the draft model scores (`--draft-vocab`): the kept
        rows of how many; None without a draft model or when it scores them all."""
        draft = self.registry.draft if self.registry is not None else None
        return vocabulary_of(draft.model) if draft is not None else None

    @property
    def speculation_costs(self) -> dict | None:
        """The single-stream cost model in use (verify and draft-step costs relative to a
        plain step), what was measured at start-up, and how many steps taught it; and the
        batched engine's forward costs in seconds and its measured/predicted calibration
        by batch size and kind of step (None until it starts); and how often the draft
        model's tokens are accepted by how sure it was (None without a draft model)."""
        if self._spec is None:
            return None
        realized = self._spec.realized
        batched = self._batched
        return {
            **self._spec.costs.snapshot(),
            "realized_tokens_per_s": realized.snapshot() if realized is not None else None,
            "draft_confidence": (
                self._spec.confidence.snapshot() if self._spec.drafter is not None else None
            ),
            "batched": (
                batched.costs.as_dict() if isinstance(batched, BatchedSpeculativeEngine) else None
            ),
        }

    @property
    def max_draft_tokens(self) -> int:
        """The largest draft length a request can get (overrides are clamped to it)."""
        return max(self.config.num_draft_tokens or 0, SpecConfig.max_draft_tokens)

    def _engine(self) -> SpeculativeEngine | BatchedEngine:
        return self._spec if self._mode == Mode.SPECULATIVE else self._batched

    def _wait_for_work(self) -> list[Command] | None:
        with self._wakeup:
            while not self._inbox and not self._has_work() and not self._stopping:
                if self._paused:  # look again soon: their clients may read or time out
                    self._wakeup.wait(0.05)
                    break
                self._wakeup.wait()
            if self._stopping:
                return None
            commands = list(self._inbox)
            self._inbox.clear()
            return commands

    def _has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def _apply(self, commands: list[Command]) -> None:
        for command in commands:
            if command.kind == "submit":
                self._waiting.append(command.tracked)
            elif command.kind == "cancel":
                self._cancel(command.request_id)
            elif command.kind == "abort_all":
                self._abort_all(command.reason)
        self._expire_timeouts()
        self._apply_backpressure()

    def _expire_timeouts(self) -> None:
        """Requests past --request-timeout end with a timeout error, freeing their slot."""
        limit = self.config.request_timeout
        if not limit:
            return
        now = time.monotonic()
        for tracked in [*self._running.values(), *self._waiting, *self._paused.values()]:
            if now - tracked.arrived > limit:
                request_id = tracked.request.request_id
                if self._running.pop(request_id, None) is not None:
                    self._engine().cancel(request_id)
                elif self._paused.pop(request_id, None) is not None:
                    tracked.parked = None
                else:
                    self._waiting.remove(tracked)
                self._finish(
                    tracked,
                    FinishReason.CANCELLED,
                    error=f"request timed out after {limit:g}s",
                    error_kind="timeout",
                )

    def _cancel(self, request_id: str) -> None:
        tracked = self._running.pop(request_id, None)
        if tracked is not None:
            self._engine().cancel(request_id)
        elif request_id in self._paused:
            tracked = self._paused.pop(request_id)
            tracked.parked = None
        else:
            tracked = next((t for t in self._waiting if t.request.request_id == request_id), None)
            if tracked is None:
                return  # already finished
            self._waiting.remove(tracked)
        self._finish(tracked, FinishReason.CANCELLED)

    def _schedule(self) -> None:
        """Pick the mode for this step, migrate at the boundary, then admit."""
        admissible = self._admissible()
        active = len(self._running) + admissible
        target = self._policy.choose(self._mode, active, idle=not self._running)
        if target != self._mode:
            self._switch(target)
            self._last_step = None
        engine = self._engine()
        for _ in range(admissible):
            if self._mode == Mode.SPECULATIVE and not engine.has_capacity:
                break
            if not self._kv_admits(self._waiting.peek()):
                break  # it waits for room in the KV budget
            self._start(self._waiting.popleft(), engine)
            self._last_step = None  # the next step prefills: not a decode-rate sample

    def _admissible(self) -> int:
        """How many waiting requests to admit now: all that fit, unless they should
        wait for the running work to finish speculatively (`spec_wait_budget`)."""
        free = min(len(self._waiting), self.config.max_num_seqs - len(self._running))
        if free > 1 or (free and self._running):
            if self._serial_wait_fits(free):
                return 0 if self._running else 1
        return free

    def _serial_wait_fits(self, free: int) -> bool:
        budget = self.config.spec_wait_budget
        if budget <= 0 or not self.throughput.serial_is_faster(len(self._running) + free):
            return False
        left = sum(
            max(0, t.request.max_tokens - t.completion_tokens) for t in self._running.values()
        )
        waiters = [(t.arrived, t.request.max_tokens) for t in islice(self._waiting, free)]
        if not self._running:  # the first waiter starts now; the others queue behind it
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
        try:
            factory = self.config.logits_processor_factory
            extra = list(factory(tracked.request)) if factory else []
            if tracked.request.constraint is not None:
                grammar = self.model_info.grammar
                extra.append(grammar.processor(tracked.request.constraint, len(prompt)))
            tracked.seq = make_sequence(tracked.request, self.registry.tokenizer, extra)
            tracked.seq.suffix = self.suffix.reader(tracked.request.cache_scope)  # its key's only
            marker = self.config.fault_marker  # a test hook (`engines.faults`)
            arm(tracked.seq, marker, self.registry.tokenizer.decode(prompt) if marker else "")
            if tracked.request.prompt_logprobs is not None:
                # Scored a chunk per iteration (`_score_step`), then it joins the engine.
                top = tracked.request.prompt_logprobs
                self._scoring.add(
                    tracked.request.request_id, PromptScorer(engine.model, prompt, top)
                )
                self._running[tracked.request.request_id] = tracked
                return
            scope = tracked.request.cache_scope
            hit = self._prefix.lookup(prompt, scope) if self._prefix else None
            if hit is None:
                state = SequenceState(tracked.seq, make_prompt_cache(self.registry.target.model), 0)
            else:
                state = SequenceState(tracked.seq, hit.cache, hit.cached, draft=hit.draft)
            tracked.cached_tokens = state.cached
            engine.admit(state)
            tracked.modes.append(self._mode.value)
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the loop
            log.exception("request %s could not start", tracked.request.request_id)
            self._finish(tracked, FinishReason.ERROR, error=str(exc))
            return
        self._running[tracked.request.request_id] = tracked

    def _resume(self, tracked: TrackedRequest, engine) -> None:
        """A paused request goes back into the engine where it stopped."""
        state, tracked.parked, tracked.paused_at = tracked.parked, None, None
        if not self._admitted(tracked, engine, state):
            return
        self._running[tracked.request.request_id] = tracked
        if tracked.modes[-1:] != [self._mode.value]:
            tracked.modes.append(self._mode.value)

    def _score_step(self) -> None:
        """One chunk of prompt scoring after the engine's step; requests whose prompts
        are scored then finish (max_tokens 0) or join the engine at their scored cache."""
        if not self._scoring:
            return
        job = self._scoring.next_job(self._running)
        engine = self._engine()
        if job is not None:
            request_id, scorer = job
            others = len(self._running) > len(self._scoring)
            try:
                scorer.step(engine.model, scoring_budget(self.config, others))
            except Exception as exc:  # noqa: BLE001 - fail this request, keep serving
                log.exception("scoring the prompt of %s failed", request_id)
                self._finish(self._running.pop(request_id), FinishReason.ERROR, error=str(exc))
            self._last_step = None  # the next step's time includes this chunk
        room = len(self._scoring) if self._mode == Mode.BATCHED else int(engine.has_capacity)
        for request_id, scorer in self._scoring.take_done(room):
            self._admit_scored(self._running[request_id], scorer, engine)

    def _admit_scored(self, tracked: TrackedRequest, scorer: PromptScorer, engine) -> None:
        tracked.prompt_logprobs = scorer.scored
        if tracked.request.max_tokens == 0:  # scoring only
            del self._running[tracked.request.request_id]
            self._finish(tracked, FinishReason.LENGTH)
            return
        state = SequenceState(tracked.seq, scorer.cache, scorer.cached)
        if not self._admitted(tracked, engine, state):
            return
        if tracked.modes[-1:] != [self._mode.value]:
            tracked.modes.append(self._mode.value)

    def _admitted(self, tracked: TrackedRequest, engine, state: SequenceState) -> bool:
        """Put a request's sequence into `engine`; if that raises, it alone fails."""
        try:
            engine.admit(state)
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the loop
            log.exception("request %s could not join the engine", tracked.request.request_id)
            self._running.pop(tracked.request.request_id, None)
            self._finish(tracked, FinishReason.ERROR, error=str(exc))
            return False
        return True

    def _switch(self, target: Mode) -> None:
        """Hand the model to the other engine, carrying in-flight requests with their
        KV caches. Runs between steps on the engine thread; no forward is in progress."""
        started = time.perf_counter()
        source = self._mode
        migrated = 0
        if target == Mode.BATCHED:
            if self._batched is None:
                self._batched = self._make_batched_engine()
                log.info("started the batched engine (first time two requests are active)")
            if self._spec.active is not None:
                state, outputs = self._spec.export()
                for output in outputs:
                    self._publish(output)
                if not state.seq.finished:
                    self.registry.transfer(BatchedEngine.name)
                    tracked = self._running[state.seq.request_id]
                    migrated = int(self._admitted(tracked, self._batched, state))
            self.registry.transfer(BatchedEngine.name)
        else:
            for output in self._batched.settle() if self._batched else []:
                self._publish(output)  # a plain step in flight commits before rows leave
            remaining = self._batched.active_ids if self._batched else []
            assert len(remaining) <= 1, "only a single request migrates back"
            self.registry.transfer(SpeculativeEngine.name)
            for request_id in remaining:
                self._spec.resume(self._batched.extract(request_id))
                migrated += 1
        self._mode = target
        for tracked in self._running.values():
            if tracked.modes[-1:] != [target.value]:
                tracked.modes.append(target.value)
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

    def _make_batched_engine(self) -> BatchedSpeculativeEngine | BatchedEngine:
        """Batched speculation when the caches roll back per row; otherwise mlx-lm's
        BatchGenerator, which batches any cache type but cannot verify drafts."""
        config = self.config
        if self.rows_roll_back:
            engine = BatchedSpeculativeEngine(
                self.registry, self._spec, config.batch_prefill_step_size
            )
            engine.checkpoint_prompts = self._checkpoint_prompts
            return engine
        return BatchedEngine(self.registry, config.max_num_seqs, config.batch_prefill_step_size)

    def _step(self) -> None:
        if not self._running:
            self._last_step = None
            return
        engine = self._engine()
        batch_size = len(self._running)
        started = time.perf_counter()
        try:
            outputs = engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the requests in this step, keep serving
            if self.registry.lockstep is not None:
                # Across ranks a failed step is most likely a lost rank, and any further
                # collective on a broken ring may never return: fail the server.
                raise
            log.exception("engine step failed")
            for request_id in list(self._running):
                engine.cancel(request_id)
                self._finish(self._running.pop(request_id), FinishReason.ERROR, error=str(exc))
            self._last_step = None
            return
        self._measure((self._mode, batch_size), sum(len(o.token_ids) for o in outputs))
        if self._mode == Mode.BATCHED:
            self.counters.record_batch(batch_size)
            self.observer.on_batch_step(batch_size)
        for output in outputs:
            self._publish(output)
        self._keep_finished_caches(engine)
        if isinstance(engine, BatchedSpeculativeEngine):
            self._observe_batched_step(engine, time.perf_counter() - started)

    def _observe_batched_step(self, engine: BatchedSpeculativeEngine, seconds: float) -> None:
        """Drafted tokens per row (speculation under load) and the step's split between
        model forwards and everything else on the engine thread."""
        if engine.step_sizes:
            drafted = [count for _, count in engine.step_sizes]
            self.observer.on_speculation_step(len(drafted), drafted)
        self.observer.on_step_time(engine.forward_seconds, seconds - engine.forward_seconds)

    def _measure(self, shape: tuple[Mode, int], tokens: int) -> None:
        """A decode-rate sample: wall time since the previous step of the same shape."""
        now = time.perf_counter()
        if self._last_step is not None and self._last_step[0] == shape:
            mode, batch_size = shape
            seconds = now - self._last_step[1]
            self.throughput.record(mode == Mode.BATCHED, batch_size, tokens, seconds)
        self._last_step = (shape, now)

    def _keep_finished_caches(self, engine) -> None:
        """Finished requests' caches, and prompt checkpoints of caches that cannot be
        cut back (`checkpoints`), become prefix-cache entries keyed by exactly the
        tokens they hold, a system prompt's checkpoint kept longest; a cache claiming
        more than its committed tokens is dropped (a shorter key over a longer KV would
        corrupt every later hit)."""
        kept = [(state, ASSISTANT) for state in engine.released]
        for state in engine.checkpoints:  # a system prompt's end, or a prompt's
            kept.append((state, SYSTEM if state.cached in state.seq.request.checkpoints else USER))
        for state, kind in kept:
            tokens = state.seq.all_tokens
            if self._prefix is not None and state.cached <= len(tokens):
                scope = state.seq.request.cache_scope
                self._prefix.store(tokens[: state.cached], state.cache, scope, state.draft, kind)
        engine.released.clear()
        engine.checkpoints.clear()

    def _publish(self, output: StepOutput) -> None:
        tracked = self._running.get(output.request_id)
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
            del self._running[output.request_id]
            self._finish(tracked, output.finish_reason, output=output, error=output.error)
            return
        self._deliver(
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
        self._deliver(tracked, event)

    def _end_all(self, reason: str, also: list[TrackedRequest] = ()) -> dict:
        """End every request (and `also`) with an error event, touching no engine;
        returns the running ones."""
        running, self._running = self._running, {}
        waiting, self._waiting = self._waiting, FairQueue(key_of)
        paused, self._paused = self._paused, {}
        for tracked in [*running.values(), *waiting, *paused.values(), *also]:
            self._finish(tracked, FinishReason.CANCELLED, error=reason, error_kind="aborted")
        return running

    def _abort_all(self, reason: str) -> None:
        """End every request with an error event first, then free engine slots best
        effort: the engine may be the thing that broke, and no client may hang on it."""
        running = self._end_all(reason)
        engine = self._engine() if self._spec is not None else None
        for request_id in running if engine is not None else ():
            try:
                engine.cancel(request_id)
            except Exception:  # noqa: BLE001 - every stream has already ended
                log.exception("could not cancel %s in the %s engine", request_id, engine.name)
