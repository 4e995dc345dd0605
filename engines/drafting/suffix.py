"""Suffix decoding: drafts from the recent requests of one API key.

Prompt lookup copies from the request's own context. An agent or a user asks much the
same thing again and again -- the same question in a new conversation, the same tool
call format, the same file read twice -- and the answer then repeats an earlier
request's output, which no lookup in the new request's context can see. `SuffixIndex`
holds a bounded number of recent sequences (prompt and output, token ids) and answers,
as a suffix tree with frequency counts would (Arctic Inference's SuffixDecoding, vLLM's
suffix decoding): which earlier positions share the longest suffix with the current
context, and what followed them, most often first.

* **Occurrences.** Every position is indexed by the `GRAM` tokens before it (its
  continuation start); a lookup takes the context's last `GRAM` tokens and extends each
  occurrence backwards while it still agrees with the context (up to `MAX_MATCH`): the
  occurrences that agree at least L tokens are the suffix tree's node at depth L.
* **Drafts.** From a node, the draft grows greedily: the continuation token most of the
  node's occurrences have next (its frequency the probability), keeping the
  occurrences that agree, while the product of probabilities stays at least
  `MIN_PROBABILITY`, for at most `FACTOR` x the match length tokens (a long match earns
  a long draft, a two-token match a short one). The deepest node and a few shallower,
  more frequent ones are tried; the draft with the most expected accepted tokens wins.
  Each drafted token carries its estimate (`Draft.confidences`): its frequency among
  the occurrences still agreeing, the first one discounted by a shallow match's
  weakness (`depth / (depth + 2)`: a two-token match is a coin flip, a 64-token match
  nearly sure) and by how often this key's suffix drafts had their first token
  accepted (`trust`, learned from its finished requests). The gate takes them as its
  prior for a match length it has not yet seen verified (`engines.gating.gates`).
* **Bounds.** The index holds at most `max_tokens` tokens; the oldest sequence is
  evicted first, and each n-gram keeps its latest `MAX_OCCURRENCES` positions. A token
  costs about `BYTES_PER_TOKEN` held (its sequence as 32-bit ints; an n-gram key packed
  in one int; an occurrence, a bare int for an n-gram seen once): 7 MB for 65536.

Everything is ints and dicts: no MLX. One index belongs to one API key
(`scheduler.suffix_store`): a request only ever reads its own key's, so another key's
request never drafts from it and cannot time it (a side channel). Proposals are only
drafts: the target verifies every token.
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict

from engines.drafting.draft import SUFFIX, Draft

GRAM = 2  # tokens a position is indexed by (the shortest match; `gram_key` packs them)
MAX_MATCH = 64  # a match is extended backwards at most this far
MAX_OCCURRENCES = 128  # latest positions kept per n-gram
MAX_CANDIDATES = 48  # latest occurrences extended backwards per lookup
LEVELS = 3  # match depths tried per lookup (the deepest and shallower ones)
MIN_PROBABILITY = 0.1  # a draft stops where its estimated probability falls below this
FACTOR = 1.0  # the longest draft: this times the match length
SHIFT = 32  # an occurrence is `sequence id << SHIFT | position`
MASK = (1 << SHIFT) - 1
BYTES_PER_TOKEN = 110  # measured with tracemalloc on 65536 tokens of a Zipf-like stream


def gram_key(tokens, end: int) -> int:
    """The two tokens before `end`, packed in one int (a dict key half a tuple's size)."""
    return tokens[end - 2] << SHIFT | tokens[end - 1]


def match_bucket(length: int) -> int:
    """The match length rounded down to a power of two: what a suffix draft's gate
    learns acceptance by (a 40-token match and a 50-token one say the same)."""
    return 1 << (max(1, length).bit_length() - 1)


class SuffixIndex:
    """The recent sequences of one key, indexed for suffix matching; bounded by tokens."""

    def __init__(self, max_tokens: int = 1 << 16) -> None:
        self.max_tokens = max_tokens
        self.sequences: OrderedDict[int, array] = OrderedDict()  # oldest first
        # gram_key -> its occurrence, or its occurrences oldest first
        self.grams: dict[int, int | list[int]] = {}
        self.tokens = 0  # held, over all sequences
        self.added = 0  # sequences ever added (the next id)
        self.evicted = 0  # sequences evicted to stay within max_tokens
        self.drafts = 0  # suffix drafts this key's finished requests verified
        self.first_accepted = 0  # of which the first token was accepted

    @property
    def trust(self) -> float:
        """How often this key's suffix drafts had their first token accepted, starting
        from two pseudo-drafts that were (a new key's index is trusted)."""
        return (self.first_accepted + 2) / (self.drafts + 2)

    def learn_acceptance(self, drafts: int, first_accepted: int) -> None:
        """A finished request's suffix drafts: how many, how many started right."""
        self.drafts += drafts
        self.first_accepted += first_accepted

    def add(self, tokens: list[int]) -> None:
        """Index a finished sequence (prompt and output); the oldest go beyond the bound.
        A sequence longer than the bound keeps its last `max_tokens` tokens."""
        tokens = array("i", tokens[-self.max_tokens :] if self.max_tokens > 0 else [])
        if len(tokens) <= GRAM:
            return
        while self.sequences and self.tokens + len(tokens) > self.max_tokens:
            self._evict_oldest()
        sid = self.added
        self.added += 1
        self.sequences[sid] = tokens
        self.tokens += len(tokens)
        grams = self.grams
        for end in range(GRAM, len(tokens)):  # the gram tokens[end-GRAM:end] continues at end
            key, occurrence = gram_key(tokens, end), sid << SHIFT | end
            held = grams.get(key)
            if held is None:  # most grams occur once: the int itself, no list
                grams[key] = occurrence
            elif isinstance(held, int):
                grams[key] = [held, occurrence]
            else:
                held.append(occurrence)
                if len(held) > MAX_OCCURRENCES:
                    del held[0]

    def _evict_oldest(self) -> None:
        sid, tokens = self.sequences.popitem(last=False)
        self.tokens -= len(tokens)
        self.evicted += 1
        for end in range(GRAM, len(tokens)):
            gram = gram_key(tokens, end)
            occurrences = self.grams.get(gram)
            if occurrences is None:
                continue  # already emptied by an earlier position of this sequence
            if isinstance(occurrences, int):
                if occurrences >> SHIFT <= sid:
                    del self.grams[gram]
                continue
            drop = 0
            while drop < len(occurrences) and occurrences[drop] >> SHIFT <= sid:
                drop += 1
            if drop == len(occurrences):
                del self.grams[gram]
            elif drop:
                del occurrences[:drop]

    def propose(self, context: list[int], k: int) -> Draft | None:
        """Up to k tokens that followed the longest suffix of `context` seen in this
        index (its match length bucketed as `match_length`), or None."""
        if k <= 0 or len(context) < GRAM:
            return None
        occurrences = self.grams.get(gram_key(context, len(context)))
        if occurrences is None:
            return None
        if isinstance(occurrences, int):
            occurrences = [occurrences]
        matched = [
            (self._agreement(context, occurrence), occurrence)
            for occurrence in reversed(occurrences[-MAX_CANDIDATES:])
        ]
        best: tuple[float, int, list[int], list[float]] | None = None
        for depth in sorted({length for length, _ in matched}, reverse=True)[:LEVELS]:
            node = [occurrence for length, occurrence in matched if length >= depth]
            limit = min(k, max(1, int(FACTOR * depth)))
            score, tokens, rates = self._grow(node, limit)
            if tokens and (best is None or score > best[0]):
                best = (score, depth, tokens, rates)
        if best is None:
            return None
        _, depth, tokens, rates = best
        rates[0] *= depth / (depth + 2) * self.trust  # a match this long, from this key
        return Draft(SUFFIX, tokens, None, match_bucket(depth), confidences=rates)

    def _agreement(self, context: list[int], occurrence: int) -> int:
        """How many tokens before the occurrence agree with the end of the context (at
        least GRAM: the occurrence was found by them)."""
        tokens = self.sequences[occurrence >> SHIFT]
        end = occurrence & MASK
        length = GRAM
        limit = min(MAX_MATCH, end, len(context))
        while length < limit and tokens[end - length - 1] == context[-length - 1]:
            length += 1
        return length

    def _grow(self, node: list[int], limit: int) -> tuple[float, list[int], list[float]]:
        """(expected accepted tokens, draft, each token's frequency among the
        occurrences that agreed up to it): the most frequent continuation of the node's
        occurrences, token by token, while its probability stays high enough."""
        tokens: list[int] = []
        rates: list[float] = []
        score, probability = 0.0, 1.0
        positions = [(self.sequences[o >> SHIFT], o & MASK) for o in node]
        while len(tokens) < limit and positions:
            counts = Counter(seq[at] for seq, at in positions if at < len(seq))
            if not counts:
                break
            token, count = counts.most_common(1)[0]
            probability *= count / len(positions)
            if probability < MIN_PROBABILITY:
                break
            rates.append(count / len(positions))
            tokens.append(token)
            score += probability
            positions = [(s, at + 1) for s, at in positions if at < len(s) and s[at] == token]
        return score, tokens, rates

    def stats(self) -> dict[str, int]:
        return {
            "bytes": self.tokens * BYTES_PER_TOKEN,  # an estimate
            "sequences": len(self.sequences),
            "tokens": self.tokens,
            "grams": len(self.grams),
            "evicted_sequences": self.evicted,
        }


class SuffixReader:
    """A request's read-only view of its own key's index: it drafts from it, never
    writes it (the scheduler adds each finished request)."""

    def __init__(self, index: SuffixIndex) -> None:
        self._index = index

    def propose(self, context: list[int], k: int) -> Draft | None:
        return self._index.propose(context, k)
