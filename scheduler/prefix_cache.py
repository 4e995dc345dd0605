"""Prompt-prefix reuse across requests (system prompts, multi-turn chats).

A thin wrapper over mlx-lm's `LRUPromptCache`: finished requests leave their KV
cache keyed by the tokens it holds; a new request starts from the longest cached
prefix of its prompt and prefills only the rest. Both engines start sequences from
a `SequenceState`, so a cache hit works the same whichever engine serves it.

With a draft model, an entry also keeps the request's draft-model cache, cut to the
same tokens (one entry, the target's layers then the draft's, so mlx-lm trims and
evicts them together): a hit then drafts at once instead of re-prefilling the draft
model over the whole prompt before its first proposal.

Entries are partitioned by `scope` (the server passes an id of the caller's API key):
a hit, and the `cached_tokens` it reports, would otherwise tell one user how much of
their prompt another user has sent (a system prompt, a document). Each partition is
an LRU of its own, and the bounds (entries, bytes) hold over all of them together:
when they are exceeded, the partition holding the most gives up its oldest entry. So
one busy key evicts its own entries, not every other user's conversation.

Each entry is of a kind, as in mlx_lm.server: `SYSTEM` (a chat's system prompt and
tools, the checkpoint every conversation with them starts from), `USER` (a prompt's
checkpoint) or `ASSISTANT` (a finished request). mlx-lm's LRU evicts finished requests
first while there are as many of them as prompt checkpoints, and prompt checkpoints
before system prompts, so a shared system prompt is not pushed out by a busy hour of
conversations that each leave two entries behind.

With a disk tier (scheduler/prefix_disk.py), what is stored is also written to disk in
the background, and a lookup that an entry on disk serves further than memory does reads
it back into memory (a restart's first request, an entry evicted from memory).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.models.cache import LRUPromptCache

from engines.cache.rollback import can_trim, trim_exact
from engines.drafting.draft_model import DraftState
from engines.request import common_prefix
from scheduler.prefix_disk import MEMO, DiskEntry, DiskTier, identities

MODEL_KEY = "target"
SYSTEM, USER, ASSISTANT = "system", "user", "assistant"  # mlx-lm's cache types
MAX_DRAFT_LAG = 16  # a draft cache this many tokens short of the target's is still kept


@dataclass
class PrefixHit:
    cache: list  # the target's KV cache, holding `cached` leading tokens of the prompt
    cached: int
    draft: DraftState | None  # the draft model's cache of the same tokens, if kept
    tier: str = "ram"  # where it came from: "ram" or "disk"


class PrefixCache:
    def __init__(
        self, max_entries: int = 16, max_bytes: int = 2 << 30, disk: DiskTier | None = None
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.disk = disk
        self.hits = {"ram": 0, "disk": 0}  # lookups served, by tier
        self._scopes: dict[str, LRUPromptCache] = {}  # only scopes holding entries
        self._target_layers = 0  # an entry's first this-many layers are the target's

    def attach(self, registry, draft_vocab: int | None = None) -> None:
        """Open the disk tier for the loaded model (engine thread, after the load)."""
        if self.disk is not None:
            memo = self.disk.directory / MEMO
            self.disk.open(identities(registry, draft_vocab, memo))

    def close(self) -> None:
        """Finish the disk tier's queued writes (at shutdown)."""
        if self.disk is not None:
            self.disk.close()

    def lookup(self, tokens: list[int], scope: str = "") -> PrefixHit | None:
        """The longest cached prefix of `tokens` among `scope`'s entries (a copy); at
        least one token is always left uncached, because the next forward needs an
        input. An entry on disk that serves more than memory does is read back first."""
        hit = self._lookup(tokens, scope)
        if self.disk is not None:
            found = self.disk.best(tokens, scope, hit.cached if hit else 0)
            loaded = self.disk.load(found[0]) if found else None
            if loaded is not None:
                self._promote(loaded, scope)
                better = self._lookup(tokens, scope)
                if better is not None and (hit is None or better.cached > hit.cached):
                    hit, better.tier = better, "disk"
        if hit is not None:
            self.hits[hit.tier] += 1
        return hit

    def disk_entry(self, tokens: list[int], scope: str = "") -> DiskEntry | None:
        """The disk entry that would serve `tokens` further than memory does, if any:
        worth reading ahead (`DiskTier.prefetch`)."""
        if self.disk is None:
            return None
        found = self.disk.best(tokens, scope, self.memory_serves(tokens, scope))
        return found[0] if found is not None else None

    def memory_serves(self, tokens: list[int], scope: str) -> int:
        """About how many of `tokens` memory serves, from mlx-lm's trie alone (a
        lookup would copy the entry): whether a file is worth reading ahead, or
        another request's prefill worth waiting for (`PrefillFollowers`)."""
        lru = self._scopes.get(scope)
        if lru is None:
            return 0
        found = lru._trie.search(MODEL_KEY, tokens)
        if found.exact is not None:
            return len(tokens) - 1
        shared = found.common_prefix if found.longer is not None else 0
        return max(len(found.shorter or ()), min(shared, len(tokens) - 1))

    def _promote(self, loaded, scope: str) -> None:
        """A disk entry into memory, as `store` keeps one (not written back)."""
        self._target_layers = loaded.target_layers
        lru = self._scopes.get(scope)
        if lru is None:
            lru = self._scopes[scope] = LRUPromptCache(self.max_entries, self.max_bytes)
        lru.insert_cache(MODEL_KEY, list(loaded.tokens), loaded.layers, cache_type=loaded.kind)
        if len(lru) == 0:
            del self._scopes[scope]
        self._fit()

    def _lookup(self, tokens: list[int], scope: str) -> PrefixHit | None:
        lru = self._scopes.get(scope)
        if lru is None:
            return None
        layers, rest = lru.fetch_nearest_cache(MODEL_KEY, tokens)
        if layers is None:
            return None
        cache, draft = layers[: self._target_layers], layers[self._target_layers :]
        cached = len(tokens) - len(rest)
        if cached == len(tokens):
            if not _trim([*cache, *draft], 1):
                return None
            cached -= 1
        if cached <= 0:
            return None
        return PrefixHit(cache, cached, DraftState(draft, list(tokens[:cached])) if draft else None)

    def store(
        self,
        tokens: list[int],
        cache: list,
        scope: str = "",
        draft: DraftState | None = None,
        kind: str = ASSISTANT,
    ) -> None:
        """Keep `cache`, which must hold exactly `tokens`, for `scope`'s lookups, with
        the draft cache when it holds nearly all of them too (both are cut to the
        tokens both hold); the caller gives them up. `kind` says how long it is kept."""
        if not tokens or not cache:
            return
        draft_layers: list = []
        if draft is not None and draft.cache:
            shared = common_prefix(draft.fed, tokens)
            close = 0 < shared and len(tokens) - shared <= MAX_DRAFT_LAG
            if close and _trim(draft.cache, len(draft.fed) - shared):
                if _trim(cache, len(tokens) - shared):
                    tokens, draft_layers = tokens[:shared], draft.cache
        self._target_layers = len(cache)
        layers = [*cache, *draft_layers]
        lru = self._scopes.get(scope)
        if lru is None:
            lru = self._scopes[scope] = LRUPromptCache(self.max_entries, self.max_bytes)
        if self.disk is not None:  # copied to host memory now, written in the background
            self.disk.save(list(tokens), layers, scope, kind, len(cache))
        lru.insert_cache(MODEL_KEY, list(tokens), layers, cache_type=kind)
        if len(lru) == 0:  # the entry alone was over the byte bound: nothing kept
            del self._scopes[scope]
        self._fit()

    def _fit(self) -> None:
        """Back within both bounds, each eviction from the scope that holds the most of
        what is over (entries, then bytes); a scope left empty is forgotten."""
        while len(self) > self.max_entries:
            self._evict_one(max(self._scopes, key=lambda s: len(self._scopes[s])))
        while self.nbytes > self.max_bytes and self._scopes:
            self._evict_one(max(self._scopes, key=lambda s: self._scopes[s].nbytes))

    def shrink_to(self, max_bytes: int) -> None:
        """Evict entries (as `_fit` does) until it holds at most `max_bytes`: running
        requests' KV needs the room (the scheduler's KV budget)."""
        while self.nbytes > max_bytes and self._scopes:
            self._evict_one(max(self._scopes, key=lambda s: self._scopes[s].nbytes))

    def _evict_one(self, scope: str) -> None:
        lru = self._scopes[scope]
        lru.trim_to(n_sequences=len(lru) - 1)  # its oldest of the kind evicted first
        if len(lru) == 0:
            del self._scopes[scope]

    @property
    def nbytes(self) -> int:
        return sum(lru.nbytes for lru in self._scopes.values())

    def __len__(self) -> int:
        return sum(len(lru) for lru in self._scopes.values())

    def stats(self) -> dict:
        """Entries, bytes and hits by tier (read from other threads: a snapshot)."""
        scopes = list(self._scopes.values())
        return {
            "entries": sum(len(lru) for lru in scopes),
            "bytes": sum(lru.nbytes for lru in scopes),
            "hits": dict(self.hits),
            "disk": self.disk.stats() if self.disk is not None else None,
        }


def _trim(cache: list, count: int) -> bool:
    """Trim `count` positions from every layer; False (untouched) if they cannot be."""
    if count == 0:
        return True
    if not can_trim(cache, count):
        return False
    trim_exact(cache, count)
    return True
