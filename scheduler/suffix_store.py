"""Each API key's suffix index: its recent requests, for suffix decoding.

The scheduler feeds every finished request's prompt and output into its key's
`SuffixIndex` (`engines.drafting.suffix`) and gives each new request a read-only
`SuffixReader` of its own key's index, never another's: a key whose requests got
faster after another key asked the same thing would learn what that key asked (a
timing side channel). The scope is the request's `cache_scope` (the API key's id; ""
on a server without keys, whose requests all share one index).

What is indexed of a request is its output and the last `PROMPT_TAIL` tokens of its
prompt before it: a match reads at most `MAX_MATCH` tokens back, and the rest of a long
prompt is the conversation so far, which the next turn's prompt holds again (and
prompt lookup searches there). An agent's turns each resend 10-20k tokens of history;
indexed whole, four of them filled a key's bound and evicted the answers that the
same session, replayed, would have drafted from.

Bounded: each key's index holds at most `tokens_per_key` tokens (its oldest sequences
are evicted first), and at most `max_keys` keys have an index (the least recently used
goes first). A key's bound is its own, so another key's traffic never evicts a key's
history -- only a new key beyond `max_keys` retires the least recently used one.
Owned by the engine thread; `stats()` returns plain ints for /metrics and /v1/stats.
"""

from __future__ import annotations

from collections import OrderedDict

from engines.drafting.draft import SUFFIX
from engines.drafting.suffix import BYTES_PER_TOKEN, MAX_MATCH, SuffixIndex, SuffixReader
from engines.sequence import Sequence

PROMPT_TAIL = 4 * MAX_MATCH  # prompt tokens indexed before each output


class SuffixStore:
    def __init__(self, tokens_per_key: int = 1 << 16, max_keys: int = 32) -> None:
        self.tokens_per_key = tokens_per_key
        self.max_keys = max_keys
        self.indexes: OrderedDict[str, SuffixIndex] = OrderedDict()  # least recent first
        self.retired_keys = 0  # indexes dropped for newer keys
        self._stats = self._totals()  # replaced whole on the engine thread; read anywhere

    @property
    def enabled(self) -> bool:
        return self.tokens_per_key > 0 and self.max_keys > 0

    def reader(self, scope: str) -> SuffixReader | None:
        """A request's view of its own key's index (None when suffix decoding is off);
        the key's index is created here if it has none, and counts as used."""
        if not self.enabled:
            return None
        return SuffixReader(self._index(scope))

    def learn(self, seq: Sequence | None) -> None:
        """Index a finished request's output, after its prompt's last tokens, under its
        key, and what its suffix drafts' verifies said of the key's index."""
        if not self.enabled or seq is None or not seq.generated:
            return
        index = self._index(seq.request.cache_scope)
        verified = seq.spec.by_method.get(SUFFIX)
        if verified is not None:
            index.learn_acceptance(verified.drafts, verified.first_accepted)
        index.add([*seq.request.prompt_tokens[-PROMPT_TAIL:], *seq.generated])
        self._stats = self._totals()

    def _index(self, scope: str) -> SuffixIndex:
        index = self.indexes.get(scope)
        if index is None:
            index = self.indexes[scope] = SuffixIndex(self.tokens_per_key)
            while len(self.indexes) > self.max_keys:
                self.indexes.popitem(last=False)
                self.retired_keys += 1
            self._stats = self._totals()
        self.indexes.move_to_end(scope)
        return index

    def stats(self) -> dict[str, int]:
        """Totals over the keys' indexes (no key's own numbers: those are its business),
        as of the latest request learned; safe to call from any thread."""
        return dict(self._stats)

    def _totals(self) -> dict[str, int]:
        indexes = list(self.indexes.values())
        return {
            "keys": len(indexes),
            "sequences": sum(len(index.sequences) for index in indexes),
            "tokens": sum(index.tokens for index in indexes),
            "bytes": sum(index.tokens for index in indexes) * BYTES_PER_TOKEN,  # estimated
            "evicted_sequences": sum(index.evicted for index in indexes),
            "retired_keys": self.retired_keys,
            "tokens_per_key": self.tokens_per_key,
            "max_keys": self.max_keys,
        }
