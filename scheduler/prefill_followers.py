"""Prefill followers: a request whose prompt shares a long prefix with a request of its
API key that is still prefilling waits for that prefill instead of repeating it.

A team starting their agents at nine sends the same 10-20k-token system prompt and
tools at once. Prefilled once per request, the slowest part of an agent session is
paid once per session: on the Codex replay from a cold cache, two sessions at once on
the 2-core CPU, the second's first token came after 393 s with 5 tokens cached,
against 192 s for one session alone.

So a newcomer (the follower) waits in the queue -- neither admitted nor counted as
active by the mode policy -- while the request it follows (the leader) prefills. The
leader's engine stops a prefill chunk at the position the follower needs and copies
its cache out there (`Sequence.keep_at`), a prefix-cache entry like any other; the
follower then starts from it and prefills only what differs. A leader that is
cancelled keeps its prefill too (`PrefixReuse.keep`), so the follower resumes from it.

A leader whose prompt is in already (it decodes) is not waited for: its cache is
copied into the prefix cache at once (`Engine.copy_cache`), and the newcomer starts from
the copy, cut back to what they share, by the lookup -- caches that cut back only. An
agent's subagents, or a retry after a client timeout, arrive while the first answer is
being written; until its request finished, nothing of its prefill was in the cache.

Only within one API key (`cache_scope`): another key's request never waits for, nor
starts from, this key's prefill. The follower stops waiting when the leader's cache
reached the position, when the leader leaves (finished, cancelled, failed, paused,
preempted), or when the leader's prefill has not moved for `stall_seconds`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engines.request import common_prefix
from scheduler.requests import Place

if TYPE_CHECKING:
    from scheduler.counters import SchedulerCounters
    from scheduler.prefix_cache import PrefixCache
    from scheduler.requests import RequestTable
    from scheduler.tracking import TrackedRequest

log = logging.getLogger(__name__)

MIN_SHARED_TOKENS = 256  # a shorter shared prefix is prefilled again, not waited for
STALL_SECONDS = 60.0  # a leader's prefill that has not moved this long is not waited for


@dataclass
class Following:
    """A waiting request's leader and how far its cache will serve it (per request, on
    its `TrackedRequest`; engine thread)."""

    leader: TrackedRequest
    ready_at: int  # the leader's prompt position whose cache is kept for the follower
    seen: int  # the leader's prefilled tokens at the last look (-1: not started)
    seen_at: float  # when they last moved


class PrefillFollowers:
    """Which waiting requests wait for another's prefill. Owned by the engine thread,
    as the request table and the prefix cache it reads; it holds no request state (each
    request's `following` lives on its `TrackedRequest`). `cuts_back`: the model's caches
    can be cut back to any shorter prefix (set at load), so a copy kept further along
    serves too. `copy_running`: copies a decoding request's cache into the prefix cache
    now (the scheduler's; False where its engine cannot)."""

    def __init__(
        self,
        cache: PrefixCache | None,
        counters: SchedulerCounters,
        min_tokens: int = MIN_SHARED_TOKENS,
        stall_seconds: float = STALL_SECONDS,
        copy_running: Callable[[TrackedRequest], bool] | None = None,
    ) -> None:
        self.cache = cache
        self.counters = counters
        self.min_tokens = min_tokens
        self.stall_seconds = stall_seconds
        self.copy_running = copy_running
        self.cuts_back = True

    @property
    def enabled(self) -> bool:
        return self.cache is not None and self.min_tokens > 0

    def waits(self, tracked: TrackedRequest, requests: RequestTable, now: float) -> bool:
        """Whether `tracked` waits for its leader's prefill (its leader found the first
        time it is asked; once it stops waiting, it never waits again)."""
        if not self.enabled:
            return False
        if not tracked.follow_checked:
            tracked.follow_checked = True
            tracked.following = self._follow(tracked, requests, now)
        following = tracked.following
        if following is None:
            return False
        outcome = self._outcome(following, requests, now)
        if outcome is None:
            return True
        tracked.following = None
        self.counters.record_prefill_follow(outcome)
        if outcome == "stalled":
            log.info(
                "request %s stops waiting for %s's prefill: no progress in %.0f s",
                tracked.request.request_id,
                following.leader.request.request_id,
                self.stall_seconds,
            )
        return False

    def _follow(
        self, tracked: TrackedRequest, requests: RequestTable, now: float
    ) -> Following | None:
        """The leader worth waiting for (the one whose prefill serves `tracked` the
        most), with the position it is asked to keep; None: start now."""
        request = tracked.request
        if tracked.parked is not None or request.prompt_logprobs is not None:
            return None
        prompt = request.prompt_tokens
        served = self.cache.memory_serves(list(prompt), request.prefix_scope)
        best: tuple[int, TrackedRequest] | None = None
        for leader in self._candidates(tracked, requests):
            other = leader.request.prompt_tokens
            reach = min(common_prefix(prompt, other), len(prompt) - 1, len(other) - 1)
            if reach - served >= self.min_tokens and (best is None or reach > best[0]):
                best = (reach, leader)
        if best is None:
            return None
        reach, leader = best
        if _prompt_in(leader):
            self._copy(tracked, leader, reach)
            return None
        ready_at = self._keep_position(leader, reach)
        if ready_at is None:
            return None
        leader.keep_at.add(ready_at)  # its sequence's own set, once it has started
        log.info(
            "request %s waits for %s's prefill of %d shared prompt tokens",
            request.request_id,
            leader.request.request_id,
            reach,
        )
        return Following(leader, ready_at, _progress(leader), now)

    def _copy(self, tracked: TrackedRequest, leader: TrackedRequest, reach: int) -> None:
        """The leader decodes: a copy of its cache now serves `tracked` up to `reach`
        (cut back by the lookup), where caches cut back and its engine hands one out."""
        if not self.cuts_back or self.copy_running is None or not self.copy_running(leader):
            return
        self.counters.record_prefill_follow("copied")
        log.info(
            "request %s starts from a copy of decoding %s's cache (%d shared prompt tokens)",
            tracked.request.request_id,
            leader.request.request_id,
            reach,
        )

    def _keep_position(self, leader: TrackedRequest, reach: int) -> int | None:
        """Where the leader's cache is copied out for a follower served up to `reach`:
        there, or -- the leader's prefill already past it -- at its prompt's end, if the
        copy can be cut back to `reach` (None: nothing left to wait for)."""
        if _progress(leader) < reach:
            return reach
        return len(leader.request.prompt_tokens) - 1 if self.cuts_back else None

    def _candidates(self, tracked: TrackedRequest, requests: RequestTable):
        """Requests of `tracked`'s key whose prompt's cache may serve it: those running
        (prefilling, or decoding with their prompt in), and those waiting ahead of it,
        but not ones that wait for a leader themselves, paused ones, nor ones whose
        prompts are scored instead."""
        scope = tracked.request.prefix_scope
        ahead = [t for t in requests.waiting if t.arrived < tracked.arrived]
        for other in [*requests.running.values(), *ahead]:
            if other is tracked or other.request.prefix_scope != scope:
                continue
            if other.parked is not None:
                continue
            if other.following is not None or other.request.prompt_logprobs is not None:
                continue
            yield other

    def _outcome(self, following: Following, requests: RequestTable, now: float) -> str | None:
        """Why the follower stops waiting now ("served", "left", "stalled"), or None."""
        leader = following.leader
        place = requests.place_of(leader.request.request_id)
        if place == Place.RUNNING and leader.first_token is not None:
            return "served"
        if place not in (Place.RUNNING, Place.WAITING) or leader.parked is not None:
            return "left"  # finished, failed, cancelled, paused or preempted
        progress = _progress(leader)
        if progress >= following.ready_at:
            return "served"
        if progress != following.seen:
            following.seen, following.seen_at = progress, now
        elif now - following.seen_at > self.stall_seconds:
            return "stalled"
        return None


def _prompt_in(leader: TrackedRequest) -> bool:
    """The leader's prompt is in its cache: it decodes (or its first token is due)."""
    end = len(leader.request.prompt_tokens) - 1
    return leader.first_token is not None or _progress(leader) >= end


def _progress(leader: TrackedRequest) -> int:
    """The prompt tokens the leader's cache holds (-1: it has not started)."""
    return leader.seq.prefilled if leader.seq is not None else -1
