"""The async scheduler: one engine thread owns all MLX work; asyncio talks to it.

Threading rule: MLX runs only on the engine thread. Other threads (the event loop,
the rank watch) talk to it through the `Mailbox`: they send commands, and receive
events through each request's `RequestStream`. The engine thread loop is `_serve`:
take the commands, let the mode policy pick the engine that owns the model
(migrating in-flight requests at this step boundary if it changes: `EnginePair`),
admit waiting requests, run one step of the owning engine, publish its tokens.
"""

from __future__ import annotations

import asyncio
import enum
import gc
import logging
import threading
import time

import mlx.core as mx

from engines.batched.engine import BatchedSpeculativeEngine
from engines.batched.fallback import BatchedEngine
from engines.errors import ContextTooLong, InvalidRequest, QueueFull, ServerNotReady
from engines.interface import Engine
from engines.model.registry import ModelRegistry
from engines.prompt_images import check_images
from engines.request import GenerationRequest, check_token_ids
from engines.sequence import FinishReason
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from scheduler.admission import Backpressure
from scheduler.admitting import Admitting
from scheduler.config import SchedulerConfig
from scheduler.counters import SchedulerCounters
from scheduler.engine_pair import EnginePair
from scheduler.kv_budget import KVBudget, make_budget
from scheduler.loading import ModelInfo, load_model
from scheduler.mailbox import Mailbox
from scheduler.observer import NullObserver, SchedulerObserver
from scheduler.pausing import Pausing
from scheduler.policy import Mode, ModePolicy
from scheduler.preemption import Preemption
from scheduler.prefill_followers import PrefillFollowers
from scheduler.prefix_cache import PrefixCache
from scheduler.prefix_disk import DiskTier, disk_tier
from scheduler.prefix_reuse import PrefixReuse
from scheduler.requests import Place, RequestTable
from scheduler.scoring import ScoringQueue
from scheduler.stepping import Stepping
from scheduler.stream import RequestStream
from scheduler.suffix_store import SuffixStore
from scheduler.throughput import ThroughputModel
from scheduler.tracking import Command, TrackedRequest

log = logging.getLogger(__name__)

LOST_RANK_GRACE_S = 2.0  # across ranks: time the engine thread gets to take a lost rank in


class SchedulerState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class Scheduler(Admitting, Stepping, Pausing, Preemption):
    """Thread ownership: `requests`, `engines`, `_reuse`, `_followers`, `_scoring`, `_policy`,
    `_last_step`, `counters`, `throughput`, `suffix` and `kv`'s reservations belong to
    the engine thread; `state`, `error` and `model_info` are written by the engine
    thread (or, as a last resort, the rank watch: `_rank_lost`) and read anywhere;
    `draining` is set on the event loop; `memory` and `measured_rates` are the engine
    thread's snapshots for readers elsewhere; the mailbox says which of its fields
    belong to whom."""

    def __init__(self, config: SchedulerConfig, observer: SchedulerObserver | None = None) -> None:
        self.config = config
        self.observer: SchedulerObserver = observer or NullObserver()
        self.state = SchedulerState.LOADING
        self.error: str | None = None
        self.model_info: ModelInfo | None = None
        self.draining = False  # shutting down: finish what runs, accept nothing new
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._mailbox = Mailbox(config.per_key_limit)
        self.requests = RequestTable()
        self.engines = EnginePair(config)
        self._backpressure = Backpressure(config.max_unread_events, config.unread_timeout)
        self._scoring = ScoringQueue()  # running requests whose prompts are being scored
        self._policy = ModePolicy(config.batch_threshold, config.batch_return_steps)
        self._prefix = (
            PrefixCache(
                config.prefix_cache_entries,
                config.prefix_cache_bytes,
                disk_tier(
                    config.prefix_cache_dir, config.prefix_cache_disk_bytes, config.distributed
                ),
            )
            if config.prefix_cache_entries > 0
            else None
        )
        self._reuse = PrefixReuse(self._prefix)
        self.counters = SchedulerCounters()
        self._followers = PrefillFollowers(
            self._prefix,
            self.counters,
            config.prefill_follow_min_tokens,
            config.prefill_follow_stall_s,
            copy_running=self._copy_prefill,
        )
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
        return self._mailbox.outstanding

    @property
    def num_running(self) -> int:
        return self.requests.num_running

    @property
    def num_waiting(self) -> int:
        return self.requests.num_waiting

    @property
    def serving(self) -> bool:
        """Whether new requests are taken: loaded, warmed up (costs measured), not
        draining. /health, /v1/models and generation all answer by this one readiness."""
        return self.state == SchedulerState.READY and not self.draining

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Admit a request and return its event stream (call on the event loop)."""
        if self.state != SchedulerState.READY or self._mailbox.stopping:
            # The failure's detail is in the log; clients get the state, not the exception.
            raise ServerNotReady(f"server is {self.state.value}")
        if self.draining:
            raise ServerNotReady("server is shutting down")
        request = self._validate(request)
        mailbox = self._mailbox
        if mailbox.outstanding >= self.config.max_queue + self.config.max_num_seqs:
            raise QueueFull(f"{mailbox.outstanding} requests in flight; retry shortly")
        if mailbox.per_key.full(request.cache_scope):
            raise QueueFull(
                f"this API key has {mailbox.per_key.limit} requests in flight, the most one "
                "key may hold; retry shortly"
            )
        loop = asyncio.get_running_loop()
        stream = RequestStream(request.request_id, self.cancel)
        tracked = TrackedRequest(request, stream, loop, arrived=time.monotonic())
        mailbox.track(tracked)
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
        self._mailbox.stop()
        if self._thread is not None:
            self._thread.join(timeout)
        self.state = SchedulerState.STOPPED

    def _validate(self, request: GenerationRequest) -> GenerationRequest:
        """The request as it will run (max_tokens cut to the KV budget), or a refusal."""
        info = self.model_info
        if not request.prompt_tokens:
            raise InvalidRequest("the prompt is empty")
        if info is not None:
            check_token_ids(request, info.vocab_size)
        check_images(request)
        if request.max_tokens < (0 if request.prompt_logprobs is not None else 1):
            raise InvalidRequest("max_tokens must be at least 1 (0 only to score the prompt)")
        context = info.context_length if info else None
        if context is not None and len(request.prompt_tokens) + request.max_tokens > context:
            raise ContextTooLong(len(request.prompt_tokens), context, request.max_tokens)
        return self._fit_kv(request)

    def _send(self, command: Command) -> None:
        self._mailbox.send(command)

    # ---- the rank watch's thread ------------------------------------------------------

    def _rank_lost(self, reason: str) -> None:
        """Across ranks, from the rank watch's thread: a rank's process has ended. The
        engine thread is told (`rank_lost`: it ends every request, /health turns 503,
        its loop stops) and usually takes it in at once, or fails on its own at its next
        forward. If it has done neither within LOST_RANK_GRACE_S, MLX left it waiting on
        the broken ring (it never returns: it is a daemon), and every stream ends here,
        from the event loop's side, touching nothing of the engine thread's."""
        self._send(Command("rank_lost", reason=reason))
        deadline = time.monotonic() + LOST_RANK_GRACE_S
        while self.state == SchedulerState.READY and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.state != SchedulerState.READY or self._mailbox.stopping:
            return  # failed, or shutting down
        log.error("%s; the engine thread is stuck; the server must be restarted", reason)
        self.error = f"engine failed: {reason}"
        self.state = SchedulerState.FAILED
        self._mailbox.stop()
        self._mailbox.end_streams(self.error)

    # ---- engine thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
            self._stop_followers()
        finally:
            if self._prefix is not None:
                self._prefix.close()  # its disk tier's queued writes
            # Work queued with async_eval (a pipelined token of a cancelled request)
            # must finish, and this thread's MLX streams (and their worker threads) be
            # destroyed here, before the thread ends: left to static destruction at
            # interpreter exit they abort the process ("terminate called without an
            # active exception").
            mx.synchronize()
            mx.clear_streams()

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
                reading = self._only_reading()
                commands = self._mailbox.wait(
                    busy=self.requests.has_work() and not reading,
                    poll=bool(self.requests.paused) or reading,
                )
                if commands is None:
                    break
                if not self._apply(commands):
                    return  # a rank was lost: every request has ended
                self._schedule()
                self._step()
                self._keep_within_budget()
                self._score_step()
                self._mailbox.flush()
                self._sample_gauges()
        except Exception as exc:  # noqa: BLE001 - the loop itself broke: report, fail all
            log.exception("engine loop failed; the server must be restarted")
            self.error = f"engine failed: {exc}"
            self.state = SchedulerState.FAILED
            self._abort_all(self.error)
            self._mailbox.flush()
            return
        self._abort_all("server is shutting down")
        self._mailbox.flush()

    def _only_reading(self) -> bool:
        """Nothing runs and every waiting request waits for its prefix's file: the
        loop looks again shortly instead of spinning beside the reader thread."""
        waiting = self.requests.waiting
        if self.requests.running or not waiting:
            return False
        return waiting.first(self._prefix_ready) is None

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
        self.engines.load(loaded, prefix_cache=self._prefix is not None)
        self._followers.cuts_back = not loaded.info.prompt_checkpoints
        if self._prefix is not None:  # its disk tier, for this model (scheduler/prefix_disk.py)
            self._prefix.attach(self.registry, self.config.draft_vocab)
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

    # ---- what other threads read ------------------------------------------------------

    @property
    def mode(self) -> Mode:
        return self.engines.mode

    @property
    def registry(self) -> ModelRegistry | None:
        return self.engines.registry

    @property
    def speculation_supported(self) -> bool:
        return self.engines.speculation_supported

    @property
    def rows_roll_back(self) -> bool:
        return self.engines.rows_roll_back

    @property
    def ranks(self) -> int:
        return self.engines.ranks

    @property
    def batched_engine(self) -> BatchedSpeculativeEngine | BatchedEngine | None:
        """None until two requests were first active at once (lazy start)."""
        return self.engines.batched

    @property
    def speculative_engine(self) -> SpeculativeEngine | None:
        return self.engines.spec

    @property
    def drafters(self) -> list[str]:
        """The drafters requests may use: "pld", "suffix", and "draft" or "mtp" (the model
        drafter)."""
        spec = self.engines.spec
        if spec is None:
            return []
        methods = ["pld"] if spec.config.enable_pld else []
        methods += ["suffix"] if self.suffix.enabled else []  # the key's earlier requests
        return methods + ([spec.drafter.method] if spec.drafter is not None else [])

    @property
    def draft_vocabulary(self) -> dict | None:
        return self.engines.draft_vocabulary

    @property
    def speculation_costs(self) -> dict | None:
        return self.engines.speculation_costs

    @property
    def prefix_disk(self) -> DiskTier | None:
        """The prefix cache's tier on disk, if any (it keeps the API-key id salt)."""
        return self._prefix.disk if self._prefix is not None else None

    @property
    def prefix_stats(self) -> dict | None:
        """The prefix cache's entries, bytes and hits by tier (memory, disk)."""
        return self._prefix.stats() if self._prefix is not None else None

    @property
    def max_draft_tokens(self) -> int:
        """The largest draft length a request can get (overrides are clamped to it): the
        cap of the settings the model is loaded with, known before it has loaded."""
        return SpecConfig.for_server(self.config.num_draft_tokens).draft_cap

    # ---- commands and the request table -------------------------------------------------

    def _engine(self) -> Engine | None:
        return self.engines.engine

    def _apply(self, commands: list[Command]) -> bool:
        """Take in the commands; False once a lost rank failed the server."""
        for i, command in enumerate(commands):
            if command.kind == "submit":
                self.requests.waiting.append(command.tracked)
            elif command.kind == "cancel":
                self._cancel(command.request_id)
            elif command.kind == "abort_all":
                self._abort_all(command.reason)
            elif command.kind == "rank_lost":
                later = [c.tracked for c in commands[i + 1 :] if c.kind == "submit"]
                self._fail(command.reason, later)
                return False
        self._expire_timeouts()
        self._apply_backpressure()
        return True

    def _fail(self, reason: str, also: list[TrackedRequest]) -> None:
        """A rank's process ended: every request ends with an error event, touching no
        engine (any collective on a broken ring may never return), /health turns 503."""
        log.error("%s; the server must be restarted", reason)
        self.error = f"engine failed: {reason}"
        self.state = SchedulerState.FAILED
        self._mailbox.stop()
        self._end_all(self.error, [*also, *self._mailbox.take_submitted()])
        self._mailbox.flush()

    def _expire_timeouts(self) -> None:
        """Requests past --request-timeout end with a timeout error, freeing their slot."""
        limit = self.config.request_timeout
        if not limit:
            return
        now = time.monotonic()
        for tracked in [t for t in self.requests if now - t.arrived > limit]:
            self._remove(tracked.request.request_id)
            self._finish(
                tracked,
                FinishReason.CANCELLED,
                error=f"request timed out after {limit:g}s",
                error_kind="timeout",
            )

    def _cancel(self, request_id: str) -> None:
        tracked = self._remove(request_id)
        if tracked is not None:  # else already finished
            self._finish(tracked, FinishReason.CANCELLED)

    def _remove(self, request_id: str) -> TrackedRequest | None:
        """Take a request out of the table; a running one leaves its engine too."""
        found = self.requests.remove(request_id)
        if found is None:
            return None
        tracked, place = found
        if place is Place.RUNNING:
            engine = self._engine()
            # the cache it built is kept for a retry, stored before any later lookup
            if engine.cancel(request_id, keep=self._reuse.cache is not None):
                self._absorb(engine.settle())
        return tracked

    def _end_all(self, reason: str, also: list[TrackedRequest] = ()) -> list[TrackedRequest]:
        """End every request (and `also`) with an error event, touching no engine;
        returns the running ones."""
        running, others = self.requests.take_all()
        for tracked in [*running, *others, *also]:
            self._finish(tracked, FinishReason.CANCELLED, error=reason, error_kind="aborted")
        return running

    def _abort_all(self, reason: str) -> None:
        """End every request with an error event first, then free engine slots best
        effort: the engine may be the thing that broke, and no client may hang on it."""
        running = self._end_all(reason)
        engine = self._engine() if self.engines.spec is not None else None
        for tracked in running if engine is not None else ():
            try:
                engine.cancel(tracked.request.request_id)
            except Exception:  # noqa: BLE001 - every stream has already ended
                log.exception(
                    "could not cancel %s in the %s engine", tracked.request.request_id, engine.name
                )
