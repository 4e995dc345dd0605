"""Keeping running requests within the KV budget (a mixin of `Scheduler`, run on the
engine thread; the budget itself is `scheduler.kv_budget`).

Admission waits while the next request's reach does not fit beside the others'
(`_kv_admits`); every iteration the caches the engines and paused requests actually
hold are measured, the prefix cache gives up what the running requests need, and if
they still pass the budget the newest running requests are preempted (`_preempt`):
each leaves the batch, its cache dropped, and waits at the head of the queue to resume
by prefilling its tokens so far. The oldest request is never preempted: alone, every
admitted request fits.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mlx_lm.models.cache import make_prompt_cache

from engines.errors import InvalidRequest
from engines.state import Drafting, SequenceState
from scheduler.kv_budget import GB, KVBudget, cache_bytes
from scheduler.policy import Mode
from scheduler.tracking import Command, TrackedRequest

if TYPE_CHECKING:
    from scheduler.engine_pair import EnginePair
    from scheduler.requests import RequestTable


class Preemption:
    """The scheduler's side of the KV budget. Its state is `kv` (`KVBudget`): its
    reservations and measurements belong to the engine thread; `limit` may be set from
    another thread (`set_kv_limit`), which then tells the engine thread to act on it."""

    kv: KVBudget | None
    requests: RequestTable
    engines: EnginePair

    @property
    def kv_stats(self) -> dict[str, int] | None:
        """Budget, reserved and measured bytes, the prefix cache's, and preemptions."""
        return self.kv.snapshot(self._prefix) if self.kv is not None else None

    def set_kv_limit(self, limit: int) -> None:
        """Change the budget (thread-safe): what runs past a lower one is preempted."""
        if self.kv is not None:
            self.kv.limit = limit
            self._send(Command("kv_budget"))

    def _fit_kv(self, request: Any) -> Any:
        """The request with its max_tokens cut to what its KV may reach alone within the
        budget, as the context's room cuts it (the reply then ends with a length reason);
        a prompt whose KV alone could never fit is refused (event loop)."""
        kv = self.kv
        if kv is None or kv.alone_fits(request):
            return request
        longest = kv.longest_alone()
        prompt = len(request.prompt_tokens)
        if longest < prompt + (1 if request.max_tokens else 0):
            need = kv.profile.bytes_at(prompt + 1)
            raise InvalidRequest(
                f"this request's KV cache needs {need / GB:.3f} GB for its prompt of {prompt} "
                f"tokens, over this server's KV budget of {kv.limit / GB:.3f} GB "
                "(--max-kv-gb); send a shorter prompt"
            )
        return replace(request, max_tokens=longest - prompt)

    def _kv_admits(self, tracked: TrackedRequest) -> bool:
        return self.kv is None or self.kv.admit(tracked.request, self._prefix)

    def _release_kv(self, tracked: TrackedRequest) -> None:
        if self.kv is not None:
            self.kv.release(tracked.request.request_id)

    def _keep_within_budget(self) -> None:
        """Measure the caches held; over the budget, preempt the newest rows."""
        if self.kv is None:
            return
        self.kv.bound_prefix(self._prefix)
        while self.kv.over(self._held_kv_bytes(), self._prefix) and self._preempt():
            pass

    def _held_kv_bytes(self) -> int:
        layers = list(_engine_layers(self._engine()))
        for tracked in self.requests.paused.values():
            if tracked.parked is not None:
                layers += _state_layers(tracked.parked)
        return cache_bytes(layers)

    def _preempt(self) -> bool:
        """Preempt the newest running request of the batch; False when none can go
        (one request left, or a batch whose rows cannot leave it)."""
        engine = self._engine()
        running = self.requests.running
        if self.engines.mode != Mode.BATCHED or not self.rows_roll_back or len(running) < 2:
            return False
        self._absorb(engine.settle())  # a plain step in flight commits first
        active = set(engine.active_ids)
        candidates = [t for rid, t in running.items() if rid in active]
        if len(candidates) < 2:
            return False
        tracked = max(candidates, key=lambda t: t.arrived)
        request_id = tracked.request.request_id
        state, result = engine.hand_over(request_id)
        self._absorb(result)  # nothing in flight: settled above
        fresh = make_prompt_cache(self.registry.target.model)  # resumes by a prefill
        # its gates and n-gram index go on; its caches (target and drafter) are freed
        drafting = Drafting(gates=state.drafting.gates, pld=state.drafting.pld)
        tracked.parked = SequenceState(state.seq, fresh, 0, drafting)
        self.requests.requeue(tracked)
        self.kv.release(request_id)
        self.kv.preemptions += 1
        return True


def _engine_layers(engine: Any) -> list:
    """The cache layers an engine holds: the batch's rows and prefill groups (target
    and draft), or the single-stream engine's sequence."""
    if engine is None:
        return []
    if hasattr(engine, "groups"):
        layers = [*engine.cache, *(engine.draft_cache or [])]
        for group in engine.groups:
            layers += [*group.cache, *(group.draft_cache or [])]
        return layers
    active = getattr(engine, "active", None)
    if active is None:
        return []
    return [*active.cache, *(active.drafting.draft.cache or [])]


def _state_layers(state: SequenceState) -> list:
    draft = state.drafting.draft.cache if state.drafting.draft is not None else None
    return [*state.cache, *(draft or [])]
