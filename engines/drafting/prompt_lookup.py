"""Prompt lookup that follows a copy through edits.

Plain prompt lookup (PLD) finds the longest recent n-gram of the context that occurred
before and proposes what followed its latest occurrence. On an edit of code -- rename a
variable, add type hints, fix a line -- the answer is the prompt's code with changes,
and plain lookup loses the copy at every change: after a renamed identifier the suffix
is the new name, which occurs only in the instruction ("rename `a` to `b`"), so lookup
proposes the instruction's words, and every later occurrence of the old name breaks the
copy again.

`CopyLookup` keeps where the copy is:

* **A copy pointer.** Every proposal remembers the source position of each token it
  proposed; the tokens that were then committed say how far the copy got, so the next
  lookup prefers, among the occurrences of the matched n-gram, the one nearest to where
  the copy would now be (the latest one when none is near). After a change, a short
  match such as `" ="` resumes the copy at the right line instead of the last `" ="`.
* **Substitutions.** When the output leaves the copy at source position p and, a few
  tokens later, a match nearest the pointer resumes it at position q, the output
  replaced `source[p:q]` by what it wrote in between. Later proposals write the
  replacement wherever that span recurs (the renamed variable's next use), so the copy
  runs through it. A substitution that a verify then rejects at its first token is
  forgotten.

Proposals are only drafts: the target verifies every token, so none of this can change
output, only how much of a draft is accepted. All state belongs to one sequence.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from engines.drafting.draft import PLD, Draft

NEAR = 64  # an occurrence this close to the copy pointer counts as where the copy is
MAX_SPAN = 8  # longest replaced or replacing span learned as a substitution (tokens)
MAX_SUBSTITUTIONS = 32  # the oldest is forgotten beyond this


@dataclass
class Proposal:
    """What the latest lookup proposed: its tokens, where each was copied from, and the
    substitution (by its replaced span) that wrote each one, if any."""

    at: int  # context length when proposed
    on_copy: bool  # it continued the copy from where the copy was
    tokens: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    substituted: list[tuple[int, ...] | None] = field(default_factory=list)

    def add(self, token: int, source: int, substituted: tuple[int, ...] | None = None) -> None:
        self.tokens.append(token)
        self.sources.append(source)
        self.substituted.append(substituted)


@dataclass
class Divergence:
    """The output left the copy: at output index `output_at`, where the copy would have
    continued at source position `source_at`."""

    output_at: int
    source_at: int


@dataclass
class CopyLookup:
    """Longest-suffix n-gram lookup over one sequence's context (prompt + output), with
    every occurrence indexed, a copy pointer and learned substitutions."""

    max_ngram: int = 3
    min_ngram: int = 1
    tokens: list[int] = field(default_factory=list)
    # index[n][ngram]: continuation positions (just after each occurrence), ascending
    index: dict[int, dict[tuple[int, ...], list[int]]] = field(default_factory=dict)
    substitutions: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)
    # the copy: context length `anchor[0]` is where source position `anchor[1]` is copied
    anchor: tuple[int, int] | None = None
    divergence: Divergence | None = None
    last: Proposal | None = None

    def __post_init__(self) -> None:
        self.index = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}

    def extend(self, tokens: list[int]) -> None:
        """Add committed tokens; only n-grams that end before the last token are indexed,
        so the current suffix never matches itself."""
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1
            for n, grams in self.index.items():
                if end - n >= 0:
                    grams.setdefault(tuple(self.tokens[end - n : end]), []).append(end)

    def sync(self, context: list[int]) -> None:
        """Catch up with the committed context (append-only; a shorter one rebuilds)."""
        if len(context) < len(self.tokens):
            self.tokens, self.substitutions = [], {}
            self.anchor = self.divergence = self.last = None
            self.index = {n: {} for n in self.index}
        self.extend(context[len(self.tokens) :])

    def propose(self, context: list[int], k: int) -> tuple[int, list[int]] | None:
        """(match length, up to k tokens) continuing the context, or None."""
        self.sync(context)
        self._follow_copy()
        if k <= 0:
            return None
        resumed = self._resume() if self.divergence is not None else None
        pointer = self._pointer()
        n, start = resumed or self._match(pointer)
        if n == 0:
            return None
        on_copy = self.anchor is not None and start == pointer
        self.last = self._continuation(start, k, on_copy)
        return n, list(self.last.tokens)

    # ---- where the copy is ----------------------------------------------------------

    def _pointer(self) -> int | None:
        """The source position the copy is at now (where it left, while the output is
        writing something else)."""
        if self.divergence is not None:
            return self.divergence.source_at
        if self.anchor is None:
            return None
        at, source = self.anchor
        return source + len(self.tokens) - at

    def _follow_copy(self) -> None:
        """Compare what was committed since the last proposal with it: a proposal the
        output followed moves the copy along; one that continued the copy and that the
        output then left starts a divergence; a substitution it wrote and the output
        did not is forgotten."""
        last, self.last = self.last, None
        if last is None:
            return
        written = self.tokens[last.at :]
        agreed = 0
        limit = min(len(written), len(last.tokens))
        while agreed < limit and written[agreed] == last.tokens[agreed]:
            agreed += 1
        if agreed and self.divergence is None:
            self.anchor = (last.at + agreed, last.sources[agreed - 1] + 1)
        if agreed < limit:
            rejected = last.substituted[agreed]
            if rejected is not None:
                self.substitutions.pop(rejected, None)
            if last.on_copy and self.divergence is None:
                self.divergence = Divergence(last.at + agreed, last.sources[agreed])

    def _match(self, pointer: int | None) -> tuple[int, int]:
        """(match length, continuation start) of the longest suffix n-gram seen before:
        its occurrence nearest the copy pointer if one is near, else its latest."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(self.tokens) < n:
                continue
            starts = self.index[n].get(tuple(self.tokens[-n:]))
            if starts:
                return n, _nearest(starts, pointer)
        return 0, -1

    def _resume(self) -> tuple[int, int] | None:
        """After a divergence: the longest suffix n-gram that occurs in the source just
        past where the output left it (at most MAX_SPAN tokens on) resumes the copy
        there, and what the output wrote in between replaced the source's span -- a
        substitution, learned if both spans are not empty (an insertion, such as a type
        hint, only resumes the copy). Long after the divergence the copy is given up."""
        divergence = self.divergence
        written = len(self.tokens) - divergence.output_at
        if written > 3 * MAX_SPAN:
            self.divergence = self.anchor = None
            return None
        for n in range(min(self.max_ngram, written), self.min_ngram - 1, -1):
            new_end = len(self.tokens) - n
            if new_end - divergence.output_at > MAX_SPAN:
                continue
            starts = self.index[n].get(tuple(self.tokens[-n:]))
            if not starts:
                continue
            first = divergence.source_at + n
            i = bisect_left(starts, first)
            if i == len(starts) or starts[i] > first + MAX_SPAN:
                continue
            start = starts[i]
            old = tuple(self.tokens[divergence.source_at : start - n])
            new = tuple(self.tokens[divergence.output_at : new_end])
            if old and new and old != new:
                self.substitutions.pop(old, None)
                self.substitutions[old] = new
                if len(self.substitutions) > MAX_SUBSTITUTIONS:
                    del self.substitutions[next(iter(self.substitutions))]
            self.divergence = None
            self.anchor = (len(self.tokens), start)
            return n, start
        return None

    def _continuation(self, start: int, k: int, on_copy: bool) -> Proposal:
        """k tokens copied from `start`, with the learned substitutions written in; a copy
        that reaches the end of the context keeps copying its own output, which
        continues periodic text (runs, loops) in full."""
        source = self.tokens
        period = len(source) - start
        proposal = Proposal(len(source), on_copy)
        position = start
        firsts = {old[0] for old in self.substitutions}
        while len(proposal.tokens) < k:
            if position >= len(source):
                back = len(proposal.tokens) - period
                if back < 0:  # substitutions shortened the copy: no period to repeat
                    break
                proposal.add(proposal.tokens[back], position)
                position += 1
                continue
            old = self._substitution_at(position, firsts)
            if old is None:
                proposal.add(source[position], position)
                position += 1
                continue
            for token in self.substitutions[old][: k - len(proposal.tokens)]:
                proposal.add(token, position, old)
            position += len(old)
        return proposal

    def _substitution_at(self, position: int, firsts: set[int]) -> tuple[int, ...] | None:
        """The substitution whose replaced span starts at `position`, if any."""
        if self.tokens[position] not in firsts:
            return None
        for old in self.substitutions:
            if tuple(self.tokens[position : position + len(old)]) == old:
                return old
        return None


def _nearest(starts: list[int], pointer: int | None) -> int:
    """The start nearest `pointer` if within NEAR of it, else the latest."""
    if pointer is None:
        return starts[-1]
    i = bisect_left(starts, pointer)
    near = [s for s in starts[max(0, i - 1) : i + 1] if abs(s - pointer) <= NEAR]
    return min(near, key=lambda s: abs(s - pointer)) if near else starts[-1]


class PromptLookupDrafter:
    """Prompt lookup for one sequence: `engines.drafting.prompt_lookup.CopyLookup` (the longest
    suffix n-gram seen before, nearest where the copy is, with the substitutions the
    output made to its source written in), as `Draft`s."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.lookup = CopyLookup(max_ngram, min_ngram)

    @property
    def tokens(self) -> list[int]:
        """The context indexed: this sequence's tokens only."""
        return self.lookup.tokens

    def propose(self, context: list[int], k: int) -> Draft | None:
        found = self.lookup.propose(context, k)
        if found is None:
            return None
        match_length, tokens = found
        return Draft(PLD, tokens, None, match_length=match_length)
