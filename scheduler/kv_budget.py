"""The KV memory budget (`--max-kv-gb`): running requests' caches and the prefix cache
together stay within it, so many long requests cannot exhaust the machine's memory
(on a Mac, exhausting unified memory freezes the whole machine).

Admission reserves each request's KV at the length it may reach (prompt + max_tokens)
as the model's caches hold it (`KVProfile`: full-attention layers grow with every
position, sliding-window layers stop at their window, recurrent state is a fixed size
per sequence). Rows of one batch share their caches' capacity -- a ragged cache pads
every row to the longest -- so the running requests together reach
`rows x bytes_at(longest reach)`, and that is what must fit. A request that does not
fit waits; one asking for more tokens than could ever fit, even alone, has its max_tokens
cut at submit to what fits (a length finish, as the context's room), and only a prompt
that could never fit is refused. The prefix cache lives in what the running requests
leave: its oldest entries go to make room.

If the caches the engines actually hold (`measured`) ever pass the budget anyway (the
budget lowered at run time, or memory the profile does not model), the newest running
requests are preempted: each leaves the engine, its cache dropped, and waits at the
head of the queue; it resumes by prefilling its prompt and its tokens so far, so no
token is lost or changed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

from engines.cache.ragged_cache import SLIDE_SLACK, RaggedKVCache

log = logging.getLogger(__name__)

GB = 1 << 30  # as --max-kv-gb and --prefix-cache-gb count
KV_SHARE = 0.5  # the default budget: this share of the memory the weights leave
BLOCK = 256  # KV caches grow their capacity in blocks of this many positions
MAX_DRAFT_PAST_WINDOW = 17  # positions a windowed row may hold past its slack while drafting


@dataclass(frozen=True)
class KVProfile:
    """What one sequence's caches hold at a given length, per the models' cache kinds."""

    per_position: int  # bytes per position of every full-attention layer together
    windows: tuple[tuple[int, int], ...] = ()  # (bytes per position, positions kept)
    fixed: int = 0  # bytes per sequence that do not grow (recurrent state)

    def bytes_at(self, positions: int) -> int:
        held = _round_up(max(positions, 1), BLOCK)
        windowed = sum(size * min(held, kept) for size, kept in self.windows)
        return held * self.per_position + windowed + self.fixed

    @classmethod
    def of(cls, models: Iterable[Any]) -> KVProfile:
        """Measured from a two-token forward of each model (target, draft) on a fresh
        cache of its own kinds."""
        per_position, windows, fixed = 0, [], 0
        for model in models:
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([[1, 2]]), cache=cache))
            for layer in cache:
                if isinstance(layer, ArraysCache):
                    fixed += sum(a.nbytes for a in layer.cache if a is not None)
                    continue
                size = _bytes_per_position(layer)
                kept = _positions_kept(layer)
                if kept is None:
                    per_position += size
                else:
                    windows.append((size, kept))
        return cls(per_position, tuple(windows), fixed)


def _bytes_per_position(layer: Any) -> int:
    arrays = [a for part in (layer.keys, layer.values) for a in _arrays(part)]
    return sum(a.nbytes // a.shape[-2] for a in arrays if a.shape[-2])


def _arrays(part: Any) -> list:
    return list(part) if isinstance(part, (tuple, list)) else [part]


def _positions_kept(layer: Any) -> int | None:
    """Positions a sliding-window layer keeps at most; None: it keeps them all."""
    if isinstance(layer, RaggedKVCache) and layer.window is not None:
        return _round_up(layer.window + SLIDE_SLACK + MAX_DRAFT_PAST_WINDOW, BLOCK)
    if isinstance(layer, RotatingKVCache):
        return layer.max_size
    return None


def default_limit(weights: int) -> int:
    """KV_SHARE of the memory the weights leave: on Metal of MLX's recommended working
    set, elsewhere of the machine's physical memory."""
    memory = 0
    if mx.metal.is_available():
        memory = int(mx.metal.device_info().get("max_recommended_working_set_size", 0))
    if not memory:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(KV_SHARE * max(memory - weights, 0))


class KVBudget:
    """Reservations of running (and paused) requests against the limit, on the engine
    thread; `alone_fits` is also asked on the event loop (it reads only the profile)."""

    def __init__(self, limit: int, profile: KVProfile) -> None:
        self.limit = limit
        self.profile = profile
        self.reserved: dict[str, int] = {}  # request id -> positions it may reach
        self.preemptions = 0
        self.measured = 0  # bytes the engines' caches held at the last look

    def reach(self, request: Any) -> int:
        return len(request.prompt_tokens) + request.max_tokens

    def alone_fits(self, request: Any) -> bool:
        return self.profile.bytes_at(self.reach(request)) <= self.limit

    def longest_alone(self) -> int:
        """The most positions one sequence may reach alone within the limit (0: none):
        what a request asking for more tokens than fit is cut to."""
        if self.profile.bytes_at(1) > self.limit:
            return 0
        low, high = 1, 1
        while self.profile.bytes_at(high) <= self.limit and high < 1 << 40:
            low, high = high, high * 2
        while high - low > 1:  # bytes_at(low) fits, bytes_at(high) does not
            middle = (low + high) // 2
            low, high = (
                (middle, high) if self.profile.bytes_at(middle) <= self.limit else (low, middle)
            )
        return low

    def projected(self, reaches: Iterable[int]) -> int:
        """Bytes rows reaching these lengths hold together (each padded to the longest)."""
        reaches = list(reaches)
        return len(reaches) * self.profile.bytes_at(max(reaches)) if reaches else 0

    @property
    def used(self) -> int:
        return self.projected(self.reserved.values())

    def admit(self, request: Any, prefix: Any) -> bool:
        """Reserve the request's reach if it fits beside the others, making room in
        the prefix cache (`prefix`, or None) if that is what it takes; a request that
        holds a reservation already (paused, resuming) goes in."""
        request_id = request.request_id
        if request_id in self.reserved:
            return True
        reach = self.reach(request)
        room = self.limit - self.projected([*self.reserved.values(), reach])
        if room < 0:
            return False
        if prefix is not None and prefix.nbytes > room:
            prefix.shrink_to(room)
        self.reserved[request_id] = reach
        return True

    def release(self, request_id: str) -> None:
        self.reserved.pop(request_id, None)

    def bound_prefix(self, prefix: Any) -> None:
        """The prefix cache keeps only what the running requests leave of the budget."""
        if prefix is not None and prefix.nbytes > self.limit - self.used:
            prefix.shrink_to(max(0, self.limit - self.used))

    def over(self, measured: int, prefix: Any) -> bool:
        """Whether the engines' caches (`measured` bytes) and the prefix cache pass the
        limit, after the prefix cache gave up what it could."""
        self.measured = measured
        prefix_bytes = prefix.nbytes if prefix is not None else 0
        if measured + prefix_bytes > self.limit and prefix_bytes:
            prefix.shrink_to(max(0, self.limit - measured))
            prefix_bytes = prefix.nbytes
        return measured + prefix_bytes > self.limit

    def snapshot(self, prefix: Any) -> dict[str, int]:
        return {
            "budget_bytes": self.limit,
            "reserved_bytes": self.used,
            "measured_bytes": self.measured,
            "prefix_cache_bytes": prefix.nbytes if prefix is not None else 0,
            "reserved_requests": len(self.reserved),
            "preemptions": self.preemptions,
        }


def cache_bytes(caches: Iterable[Any]) -> int:
    """Bytes held by cache layers (KV buffers at their capacity, recurrent state),
    each array once."""
    seen, total = set(), 0
    for layer in caches:
        if isinstance(layer, ArraysCache):
            state = layer.cache
        else:
            state = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for array in _flatten(state):
            if isinstance(array, mx.array) and id(array) not in seen:
                seen.add(id(array))
                total += array.nbytes
    return total


def _flatten(state: Any) -> list:
    if isinstance(state, (tuple, list)):
        return [a for part in state for a in _flatten(part)]
    return [state]


def make_budget(limit: int | None, models: list, weights: int) -> KVBudget:
    """The budget for these models (target, draft): `limit` bytes, or by default
    `default_limit`; logged, so an operator sees it at startup."""
    profile = KVProfile.of(models)
    budget = KVBudget(limit if limit is not None else default_limit(weights), profile)
    per_token = profile.bytes_at(BLOCK) / BLOCK
    log.info(
        "KV budget %.2f GB (%s): about %.0f KB per token of a request",
        budget.limit / GB,
        "--max-kv-gb" if limit is not None else f"{KV_SHARE:.0%} of the memory the weights leave",
        per_token / 1e3,
    )
    return budget


def _round_up(n: int, step: int) -> int:
    return (n + step - 1) // step * step
