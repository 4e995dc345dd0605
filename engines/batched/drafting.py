"""The batched engine's rows, and their draft-model proposals made in one batch.

A `BatchRow` is one running sequence with its own drafting state: its gates, its
n-gram index and the tokens its row of the draft model's ragged cache holds. The
draft model drafts for every row that wants it at once: one forward per drafted
position over all rows (rows that do not draft feed nothing and keep their length),
after a catch-up forward that feeds each row what it has not seen.

Invariant: draft-cache row i holds exactly `rows[i].draft_fed`, a prefix of the
row's committed tokens followed by tokens it drafted; a rollback keeps only the
committed prefix. A failed draft changes no request's tokens: the rows it belongs to
draft on without the drafter that failed (`containment`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from engines.batched.containment import stop_drafting
from engines.batched.costs import BatchCosts, BatchPlan, RowOption, choose_draft_length
from engines.cache.ragged_cache import (
    RaggedKVCache,
    feed_chunk,
    feed_rows,
    pinned,
    set_row_length,
)
from engines.drafting.draft import DRAFT, PLD, SUFFIX, Draft
from engines.drafting.draft_model import DraftState, choose_draft_token, shared_prefix
from engines.drafting.draft_vocab import OwnTokens, bind_own
from engines.faults import RowFault, check
from engines.gating.gates import expected_tokens
from engines.sequence import Sequence
from engines.state import Drafting


@dataclass
class BatchRow:
    """One running sequence and its drafting state (all of it the request's own, read
    and changed on the engine thread only)."""

    seq: Sequence
    # the request's own drafting state (`drafting.draft` is None here: its draft cache
    # is this row of the batch's; `drafting.mtp` None when it may not use the head)
    drafting: Drafting
    draft_fed: list[int] = field(default_factory=list)  # tokens in its draft-cache row
    drafts: list[int] = field(default_factory=list)  # this step's proposal
    draft_length: int = 0  # how many tokens the draft model drafts for it this step
    probs: mx.array | None = None  # (k, V) q of a sampled draft-model proposal
    method: str | None = None
    match: int = 0  # the match length of this step's lookup proposal (PLD's or SUFFIX's)
    own: OwnTokens = field(default_factory=OwnTokens)  # its tokens a reduced draft scores
    # the draft model failed on it: its draft-cache row is fed no more, and it leaves
    # without a draft state (its gate is gone too: `containment.contain_draft_failure`)
    drafter_failed: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.seq.all_tokens


def plan_rows(
    rows: list[BatchRow], costs: BatchCosts, row_cap, model_drafter: str | None
) -> BatchPlan:
    """Each row's lookup proposal (prompt lookup's, or the suffix drafter's from its
    key's earlier requests, whichever is expected to commit more) and drafting
    options, then the step's plan: the draft length K with the best expected tokens
    per second, and each row's method at K
    (`model_drafter`, DRAFT or MTP, names the model drafter; None: there is none).
    `row_cap(row, method)` is the longest draft the row may propose."""
    options, caps = [], []
    for row in rows:
        row.drafts, row.probs, row.method, row.draft_length = [], None, None, 0
        cap, pld_cap = row_cap(row, DRAFT), row_cap(row, PLD)
        caps.append(max(cap, pld_cap))
        row_options = []
        proposal, acceptance = lookup_proposal(row, pld_cap) if pld_cap > 0 else (None, ())
        if proposal is not None:
            row.drafts, row.method = proposal.tokens, proposal.method
            row.match = proposal.match_length
            row_options.append(RowOption(acceptance, len(proposal.tokens), False))
        if cap > 0 and DRAFT in row.drafting.gates and model_drafter is not None:
            row_options.append(RowOption(row.drafting.gates[DRAFT].acceptance(), cap, True))
        options.append(row_options)
    k_max = max(caps, default=0)
    if k_max == 0:
        return costs.plain_plan(len(rows))
    plan = choose_draft_length(costs, options, k_max)
    for row, row_options in zip(rows, options, strict=True):
        choose_row_method(row, row_options, plan.k, plan.with_model)
        if row.method == DRAFT:  # counted as the model drafter it is (DRAFT or MTP)
            row.method = model_drafter
    if plan.with_model and not any(row.method == model_drafter for row in rows):
        plan = costs.plan(len(rows), plan.k, False, plan.tokens)
    return plan


def lookup_proposal(row: BatchRow, cap: int) -> tuple[Draft | None, tuple[float, ...]]:
    """The row's better lookup proposal and its acceptance, by expected committed
    tokens at its gate's acceptance for its match length (a suffix draft's own
    estimate for a match length not yet verified): prompt lookup's (its own context; it
    wins a tie) or the suffix drafter's (its key's earlier requests). A suffix gate with
    nothing to propose rests a few tokens."""
    candidates = []
    if PLD in row.drafting.gates:
        candidates.append(_proposal(row, PLD, lambda: row.drafting.pld.propose(row.tokens, cap)))
    gate = row.drafting.gates.get(SUFFIX)
    if gate is not None and gate.due and row.seq.suffix is not None:
        suffix = _proposal(row, SUFFIX, lambda: row.seq.suffix.propose(row.tokens, cap))
        if suffix is None and SUFFIX in row.drafting.gates:
            gate.rest()
        candidates.append(suffix)
    best, best_acceptance, best_gain = None, (), 0.0
    for draft in candidates:
        if draft is None:
            continue
        gate = row.drafting.gates[draft.method]
        acceptance = gate.acceptance(draft.match_length, draft.confidences or None)
        gain = expected_tokens(acceptance, len(draft.tokens))
        if gain > best_gain:
            best, best_acceptance, best_gain = draft, acceptance, gain
    return best, best_acceptance


def _proposal(row: BatchRow, method: str, propose: Callable[[], Draft | None]) -> Draft | None:
    """`propose()`: the row's lookup proposal by `method`. One that raises turns the
    method off for the row (`containment.stop_drafting`), which goes on without it."""
    try:
        check([row], "lookup")
        return propose()
    except Exception as exc:  # noqa: BLE001 - a lookup only proposes: the row goes on
        stop_drafting([row], method, exc, f"a {method} proposal")
        return None


def choose_row_method(row: BatchRow, options: list[RowOption], k: int, with_model: bool) -> None:
    """At draft length k, the row drafts with its better method (PLD is free; the
    draft model only when the step runs it), or not at all when k is 0."""
    if k == 0:
        row.drafts, row.method = [], None
        return
    best, chosen = 0.0, None
    for option in options:
        if option.uses_draft_model and not with_model:
            continue
        gain = expected_tokens(option.acceptance, min(k, option.cap))
        if gain > best:
            best, chosen = gain, option
    if chosen is None:
        row.drafts, row.method = [], None
    elif chosen.uses_draft_model:
        row.drafts, row.method, row.draft_length = [], DRAFT, min(k, chosen.cap)
    else:
        row.drafts = row.drafts[:k]


def roll_back_draft(cache: list[RaggedKVCache], rows: list[BatchRow], index: int) -> None:
    """Draft row `index` keeps only the prefix it shares with the committed tokens."""
    row = rows[index]
    shared = shared_prefix(row.draft_fed, row.tokens)
    if shared < len(row.draft_fed):
        set_row_length(cache, index, shared)
        del row.draft_fed[shared:]


def draft_with_model(
    model, cache: list[RaggedKVCache], rows: list[BatchRow], vocab: int, chunk: int
) -> int:
    """`row.draft_length` draft tokens for every row whose method is DRAFT (into
    `row.drafts` and, when sampled, `row.probs`); every row's draft cache catches up
    with its tokens. A row stops at its own length (its request's num_draft_tokens, the
    tokens it has left) while others draft on. Returns the draft forwards run."""
    lengths = [row.draft_length if row.method == DRAFT else 0 for row in rows]
    k = max(lengths, default=0)
    model = bind_own(model, [row.own for row in rows], [row.tokens for row in rows])
    pending = []
    for i, row in enumerate(rows):
        roll_back_draft(cache, rows, i)
        pending.append([] if row.drafter_failed else row.tokens[len(row.draft_fed) :])
    while max(len(p) for p in pending) > chunk:  # a long gap catches up in chunks
        head = [p[: max(0, len(p) - 1)][:chunk] for p in pending]
        _feed(model, cache, rows, head)
        pending = [p[len(h) :] for p, h in zip(pending, head, strict=True)]
    logits = _feed(model, cache, rows, pending)
    last = mx.array([max(0, len(p) - 1) for p in pending])
    logits = mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0, :vocab]
    with pinned(cache, [len(row.draft_fed) for row in rows]):  # a rollback goes back here
        proposals = chain_rows(model, cache, rows, logits, lengths)
        check([row for row in rows if not row.drafter_failed], "draft")
    for row, proposal in zip(rows, proposals, strict=True):
        row.draft_fed.extend(proposal[:-1])  # every draft but the last was fed
    return k


def chain_rows(
    model, cache: list[RaggedKVCache], rows: list[BatchRow], logits: mx.array, lengths: list[int]
) -> list[list[int]]:
    """From each row's next-token `logits` (B, V), `lengths[i]` drafts for row i, each
    fed to the next forward of `model` (a draft model, or the MTP head's steps) but the
    last, into `row.drafts` (and `row.probs` when sampled); returns the proposals.
    A row stops at its own length while others draft on; its cache grows by the
    drafts it fed, the others keep their length."""
    k = max(lengths, default=0)
    if k and all(_greedy(row) for row, length in zip(rows, lengths, strict=True) if length):
        proposals = _greedy_chain(model, cache, logits, lengths)
        for row, proposal in zip(rows, proposals, strict=True):
            if proposal:
                row.drafts, row.probs = proposal, None
        return proposals
    proposals: list[list[int]] = [[] for _ in rows]
    probs: list[list[mx.array]] = [[] for _ in rows]
    for step in range(k):
        drafting = [step < length for length in lengths]
        tokens = choose_tokens(rows, logits.astype(mx.float32), drafting, proposals, probs)
        if step + 1 == k:
            break
        # a row feeds its draft only if it drafts another after it
        feed = [[t] if step + 1 < lengths[i] else [] for i, t in enumerate(tokens)]
        logits = feed_rows(model, cache, feed)[:, 0, : logits.shape[-1]]
    for i, row in enumerate(rows):
        if lengths[i]:
            row.drafts = proposals[i]
            row.probs = mx.stack(probs[i]) if probs[i] else None
    return proposals


def _greedy(row: BatchRow) -> bool:
    return row.seq.request.sampling.greedy and not row.seq.processors


def _greedy_chain(
    model, cache: list[RaggedKVCache], logits: mx.array, lengths: list[int]
) -> list[list[int]]:
    """Greedy drafts of `lengths[i]` tokens per row, queued as one lazy chain -- each
    step's argmax fed to the next forward as an array (`mx.async_eval`) -- and read
    once at the end, as the single-stream drafter does: one wait per proposal instead
    of one per drafted position (on a small draft model the waits, not the compute,
    were most of a draft step). Row i's cache grows by the drafts it feeds (all but its
    last); rows that stop earlier keep their length."""
    steps = []
    for step in range(max(lengths)):
        tokens = mx.argmax(logits.astype(mx.float32), axis=-1)
        mx.async_eval(tokens)
        steps.append(tokens)
        if step + 1 == max(lengths):
            break
        grown = [n + (step + 1 < k) for n, k in zip(cache[0].lengths, lengths, strict=True)]
        logits = model(tokens[:, None], cache=cache)[:, 0, : logits.shape[-1]]
        for layer in cache:
            layer.set_lengths(grown)
    drafted = mx.stack(steps, axis=1).tolist()
    return [row[:k] for row, k in zip(drafted, lengths, strict=True)]


def _feed(model, cache, rows: list[BatchRow], tokens: list[list[int]]) -> mx.array:
    logits = feed_rows(model, cache, tokens)
    for row, fed in zip(rows, tokens, strict=True):
        row.draft_fed.extend(fed)
    return logits


def choose_tokens(rows, logits, drafting, proposals, probs) -> list[int]:
    """Each drafting row's next draft token: greedy rows by one argmax over the
    batch, the others from their own processed q with their own RNG (keyed by
    output position when seeded)."""
    chosen = mx.argmax(logits, axis=-1).tolist()
    for i, row in enumerate(rows):
        if not drafting[i]:
            continue
        params = row.seq.request.sampling
        if not (params.greedy and not row.seq.processors):
            history = [*row.tokens, *proposals[i]]
            position = len(row.seq.generated) + len(proposals[i])
            try:  # the row's own sampling and processors: a failure is the row's
                chosen[i], q = choose_draft_token(
                    logits[i : i + 1], params, row.seq.rng, row.seq.processors, history, position
                )
            except Exception as exc:
                raise RowFault([row.seq.request_id], f"drafting for it: {exc}") from exc
            if q is not None:
                probs[i].append(q[0])
        proposals[i].append(chosen[i])
    return chosen


class DraftModelRows:
    """The draft model as the batch's model drafter: each row's draft-cache row as it
    joins, fed beside the target's prefill, the rows' proposals (`draft_with_model`),
    and the cache a row takes with it. `BatchedMTP` (the MTP head) answers the same
    calls, so the engine never asks which model drafter it has."""

    method = DRAFT
    fed_with_target = False  # its cache is fed by its own forwards (`draft_fed`)

    def __init__(self, model, vocab_size: int, chunk: int) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.chunk = chunk

    def join(self, row: BatchRow, draft: DraftState | None, mtp=None) -> list:
        return draft_row_cache(self.model, row, draft)

    def prefill(self, rows: list[BatchRow], cache: list, before, after) -> None:
        """Feed the group's draft rows their next prompt chunk (the target's done)."""
        fed = feed_chunk(self.model, cache, [r.tokens[:-1] for r in rows], self.chunk)
        for row, length in zip(rows, fed, strict=True):
            row.draft_fed = row.tokens[:length]

    def draft(self, cache: list, rows: list[BatchRow], target=None) -> tuple[int, bool]:
        """(draft forwards run, whether every row was caught up: a steady cost)."""
        fed = [rows[i] for i in self.drafting_rows(rows)]
        steady = all(len(row.tokens) - len(row.draft_fed) <= 2 for row in fed)
        return draft_with_model(self.model, cache, rows, self.vocab_size, self.chunk), steady

    def drafting_rows(self, rows: list[BatchRow]) -> list[int]:
        """The rows a draft feeds (every row the draft model has not failed on)."""
        return [i for i, row in enumerate(rows) if not row.drafter_failed]

    def recover(self, cache: list, rows: list[BatchRow], failed: list[int]) -> None:
        """After a draft that raised: every draft-cache row holds exactly `draft_fed`
        again (a forward that failed may have written past it; `draft_fed` grows only
        once a forward is done, and `pinned` keeps a window able to go back that far),
        and the `failed` rows' are fed no more."""
        for i, row in enumerate(rows):
            set_row_length(cache, i, len(row.draft_fed))
        for i in failed:
            rows[i].drafter_failed = True

    def copy(self, cache: list, rows: list[BatchRow], index: int) -> DraftState | None:
        """Row `index`'s draft cache as it is and the tokens it holds, drafts included (a
        copy for the prefix cache, which cuts it to the target's tokens); the row goes
        on unchanged. None after the draft model failed on the row."""
        if rows[index].drafter_failed:
            return None
        return DraftState([layer.extract(index) for layer in cache], list(rows[index].draft_fed))

    def leave(
        self, cache: list, rows: list[BatchRow], index: int
    ) -> tuple[DraftState | None, None]:
        roll_back_draft(cache, rows, index)
        state = self.copy(cache, rows, index)
        if state is not None:
            state.own = rows[index].own
        return state, None

    def check(self, cache: list, rows: list[BatchRow]) -> None:
        assert all(cache[0].lengths[i] == len(row.draft_fed) for i, row in enumerate(rows)), (
            "draft row out of step"
        )


def draft_row_cache(draft_model, row: BatchRow, draft: DraftState | None) -> list | None:
    """The row's draft cache, per layer as the draft model makes it (a sliding-window
    layer keeps its window: a one-row `RaggedKVCache`), rolled back to the prefix it
    shares with the committed tokens (a migrated state may hold drafted ones). A slid
    window that cannot go back that far starts the row's draft cache afresh: drafting
    catches it up from the committed tokens."""
    if draft_model is None:
        return None
    if draft is None or draft.cache is None:
        return make_prompt_cache(draft_model)
    shared = shared_prefix(draft.fed, row.tokens)
    row.own = draft.own
    cache = [_truncated(layer, shared) for layer in draft.cache]
    if any(layer is None for layer in cache):
        row.draft_fed = []
        return make_prompt_cache(draft_model)
    row.draft_fed = draft.fed[:shared]
    return cache


def _truncated(layer: KVCache | RaggedKVCache, length: int) -> KVCache | RaggedKVCache | None:
    """A copy of one layer of a single sequence's cache holding its first `length`
    positions; None when a sliding window no longer reaches back to `length`."""
    if isinstance(layer, RaggedKVCache):
        if not layer.trimmable(layer.lengths[0] - length):
            return None
        row = layer.take([0])
        row.set_lengths([length])
        return row
    cache = KVCache()
    if length and layer.keys is not None:
        cache.keys, cache.values = layer.keys[..., :length, :], layer.values[..., :length, :]
        cache.offset = length
    return cache
