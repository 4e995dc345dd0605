"""Prefix reuse: where a request's sequence starts, and which caches are kept.

A new request starts from the longest cached prefix of its prompt (or an empty
cache). Finished requests' caches, and prompt checkpoints of caches that cannot be
cut back (a system prompt's end kept longest), become prefix-cache entries keyed by
exactly the tokens they hold.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from mlx_lm.models.cache import make_prompt_cache

from engines.request import image_scope
from engines.sequence import Sequence
from engines.state import SequenceState
from scheduler.prefix_cache import ASSISTANT, SYSTEM, USER, PrefixCache

if TYPE_CHECKING:
    from scheduler.tracking import TrackedRequest


class PrefixReuse:
    """The scheduler's side of the prefix cache (None: no reuse). Owned by the engine
    thread, like the cache itself; other threads only read its size for stats."""

    def __init__(self, cache: PrefixCache | None) -> None:
        self.cache = cache

    def start(self, seq: Sequence, model) -> SequenceState:
        """The sequence with the cache of its prompt's longest cached prefix."""
        request = seq.request
        prompt, images = list(request.prompt_tokens), request.images
        hit = None
        # A prompt's text up to its k-th image is that of prompts holding its first k
        # images (none: any of its key's text prompts): their entries serve it there. An
        # agent's new screenshot comes after a conversation cached with the earlier ones.
        for count in range(len(images), -1, -1) if self.cache is not None else ():
            end = len(prompt) if count == len(images) else images[count].start + 1
            if hit is not None and hit.cached >= end - 1:
                break
            scope = image_scope(request.cache_scope, images[:count])
            found = self.cache.lookup(prompt[:end], scope)
            if found is not None and (hit is None or found.cached > hit.cached):
                hit = found
        if hit is None:
            return SequenceState(seq, make_prompt_cache(model), 0)
        return SequenceState.entry(seq, hit.cache, hit.cached, hit.draft)

    def waits_for_disk(self, tracked: TrackedRequest) -> bool:
        """Whether `tracked` waits for a disk entry to be read for it: the engine thread
        never waits for a file, and the other requests start and decode meanwhile. One
        file is read at a time; a request whose entry waits for that asks again later."""
        cache, request = self.cache, tracked.request
        if cache is None or cache.disk is None or tracked.disk_checked:
            return tracked.disk_entry is not None and cache.disk.reading(tracked.disk_entry)
        if tracked.parked is not None or request.prompt_logprobs is not None:
            return False
        entry = cache.disk_entry(list(request.prompt_tokens), request.prefix_scope)
        if entry is not None and cache.disk.reading():
            return True  # its turn comes when the file being read is in
        tracked.disk_checked, tracked.disk_entry = True, entry
        if entry is not None:
            cache.disk.prefetch(entry)
        return entry is not None

    def keep(self, released: Iterable[SequenceState], checkpoints: Iterable[SequenceState]) -> None:
        """Store finished requests' caches (`released`) and prompt checkpoints; a cache
        claiming more than its committed tokens is dropped (a shorter key over a longer
        KV would corrupt every later hit)."""
        if self.cache is None:
            return
        kept = [(state, ASSISTANT) for state in released]
        for state in checkpoints:  # a system prompt's end, or a prompt's
            kept.append((state, SYSTEM if state.cached in state.seq.request.checkpoints else USER))
        for state, kind in kept:
            tokens = state.seq.all_tokens
            if state.cached <= len(tokens):
                scope = state.seq.request.prefix_scope
                self.cache.store(
                    tokens[: state.cached], state.cache, scope, state.drafting.draft, kind
                )
