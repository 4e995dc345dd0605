"""Prompt-prefix reuse across requests (system prompts, multi-turn chats).

A thin wrapper over mlx-lm's `LRUPromptCache`: finished requests leave their KV
cache keyed by the tokens it holds; a new request starts from the longest cached
prefix of its prompt and prefills only the rest. Both engines start sequences from
a `SequenceState`, so a cache hit works the same whichever engine serves it.

Entries are partitioned by `scope` (the server passes an id of the caller's API key):
a hit, and the `cached_tokens` it reports, would otherwise tell one user how much of
their prompt another user has sent (a system prompt, a document). The partitions
share one LRU and its bounds.
"""

from __future__ import annotations

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

MODEL_KEY = "target"


class PrefixCache:
    def __init__(self, max_entries: int = 16, max_bytes: int = 2 << 30) -> None:
        self._lru = LRUPromptCache(max_size=max_entries, max_bytes=max_bytes)

    def lookup(self, tokens: list[int], scope: str = "") -> tuple[list | None, int]:
        """(cache copy, number of leading `tokens` it holds), from `scope`'s entries
        only; at least one token is always left uncached, because the next forward
        needs an input."""
        cache, rest = self._lru.fetch_nearest_cache((MODEL_KEY, scope), tokens)
        if cache is None:
            return None, 0
        cached = len(tokens) - len(rest)
        if cached == len(tokens):
            if not can_trim_prompt_cache(cache):
                return None, 0
            trim_prompt_cache(cache, 1)
            cached -= 1
        return (cache, cached) if cached > 0 else (None, 0)

    def store(self, tokens: list[int], cache: list, scope: str = "") -> None:
        """Keep `cache`, which must hold exactly `tokens`, for `scope`'s lookups; the
        caller gives it up."""
        if tokens and cache:
            self._lru.insert_cache((MODEL_KEY, scope), list(tokens), cache)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    def __len__(self) -> int:
        return len(self._lru)
