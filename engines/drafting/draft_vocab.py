"""A draft model whose output layer scores only the tokens it is likely to propose.

On a large vocabulary the draft's output projection is a big share of its cost:
Qwen2.5-0.5B's tied 151,936 x 896 head is 136M of its 494M parameters, paid for every
draft token. A draft restricted to the frequent tokens (FR-Spec, Zhao et al. 2025; EAGLE-3
drafts the same way) computes only those rows and proposes almost the same tokens.
Byte-level BPE tokenizers number their merges in the order they were learned, most
frequent first, so the first N ids are the frequent ones; every special token joins them,
whatever its id, so a draft can still propose an end of turn. Each request adds its own
tokens (`OwnTokens`: those of its prompt and output outside the frequent ones, which is
where a rare identifier a code answer repeats comes from); one request's tokens are never
scored for another's row.

Exactness does not depend on the draft: the target verifies every proposal over its full
vocabulary, and a sampled draft carries the q it was drawn from, in which the tokens left
out have probability 0, so the rejection rule stays exact. A token the draft cannot name
costs only that draft position.

The logits keep the full width, the tokens left out at a large negative value, so every
drafter, processor and grammar mask works on them unchanged. A draft is reduced only when
a check at load shows its logits equal the full head's on the kept rows (a model that
scales or caps its logits after the head keeps its whole head).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

log = logging.getLogger(__name__)

# Below any real logit, and still finite: a grammar that masks every kept token leaves
# softmax a uniform choice among the rest instead of NaNs.
LEFT_OUT_LOGIT = -1e9
# By default a draft whose vocabulary has more than AUTO_FROM rows scores AUTO_ROWS of
# them (and each request's own). On Qwen2.5-Coder-1.5B with its 0.5B draft, replayed
# (`tandem bench draft-ceiling --draft-vocab`): 16384 rows cost 0.72 of the whole draft
# and keep 82% of first draft tokens accepted (86% whole), 32768 rows 0.78 and 84%; the
# confidence stop gains 4.5% and 2.5% over the whole draft.
AUTO_ROWS = 16384
AUTO_FROM = 65536


# A request scores at most this many tokens of its own (once it has this many, later
# ones are not added; the batch that crosses the cap keeps its lowest ids): a huge
# prompt of rare tokens must not make each draft token cost more than the whole head.
MAX_OWN = 8192


@dataclass
class OwnTokens:
    """One request's tokens outside the draft's kept rows (it lives with the request),
    and the view of the draft bound to them, kept while they do not change."""

    ids: list[int] = field(default_factory=list)
    scanned: int = 0  # context tokens looked at so far
    view: tuple[Any, Any] | None = None  # (draft, that draft bound to `ids`) or None

    def update(self, context: list[int], kept: bytearray) -> list[int]:
        """Take in the context's new tokens; returns `ids`."""
        if self.scanned > len(context):  # a different context: start over
            self.ids, self.scanned, self.view = [], 0, None
        new = {t for t in context[self.scanned :] if 0 <= t < len(kept) and not kept[t]}
        # most steps bring no token outside the kept rows: no set of `ids` built for them
        if new and len(self.ids) < MAX_OWN and not new.issubset(self.ids):
            self.ids = sorted(set(self.ids) | new)[:MAX_OWN]
            self.view = None
        self.scanned = len(context)
        return self.ids


@dataclass(frozen=True)
class HeadRows:
    """Some rows of an output head (plain or quantized), gathered once."""

    weight: mx.array
    scales: mx.array | None
    biases: mx.array | None
    bias: mx.array | None

    @classmethod
    def of(cls, head: Any, index: mx.array) -> HeadRows:
        def rows(name: str) -> mx.array | None:
            return head[name][index] if name in head else None

        return cls(rows("weight"), rows("scales"), rows("biases"), rows("bias"))

    def project(self, hidden: mx.array, quantized: dict) -> mx.array:
        if self.scales is not None:
            logits = mx.quantized_matmul(
                hidden,
                self.weight,
                scales=self.scales,
                biases=self.biases,
                transpose=True,
                **quantized,
            )
        else:
            logits = hidden @ self.weight.T
        return logits + self.bias if self.bias is not None else logits


def kept_token_ids(tokenizer: Any, rows: int, vocab_size: int) -> list[int]:
    """The first `rows` ids and every special or added token (below `vocab_size`)."""
    kept = set(range(min(rows, vocab_size)))
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    kept.update(getattr(hf, "all_special_ids", None) or ())
    kept.update(getattr(hf, "added_tokens_decoder", None) or ())
    kept.update(getattr(tokenizer, "eos_token_ids", None) or ())
    return sorted(i for i in kept if 0 <= i < vocab_size)


def output_head(model: Any) -> Any | None:
    """The module whose rows are the output projection (lm_head, or the tied embedding)."""
    head = getattr(model, "lm_head", None)
    if head is not None:
        return head
    return getattr(getattr(model, "model", None), "embed_tokens", None)


class ReducedVocabDraft:
    """`model` with an output layer of only the `kept` rows (and, bound to requests,
    their own tokens); logits still full width."""

    def __init__(self, model: Any, kept: list[int]) -> None:
        self.inner = model
        self.kept = kept
        self.head = output_head(model)
        self.vocab_rows = self.head["weight"].shape[0]
        self.kept_mask = bytearray(self.vocab_rows)
        for token in kept:
            self.kept_mask[token] = 1
        self._kept = HeadRows.of(self.head, mx.array(kept, dtype=mx.int32))
        self._quantized = {
            "group_size": getattr(self.head, "group_size", None),
            "bits": getattr(self.head, "bits", None),
            "mode": getattr(self.head, "mode", "affine"),
        }
        # token id -> its column among the kept rows; ids left out -> the floor column
        positions = [len(kept)] * self.vocab_rows
        for column, token in enumerate(kept):
            positions[token] = column
        self._positions = mx.array(positions, dtype=mx.int32)
        self.left_out = next(t for t in range(self.vocab_rows) if not self.kept_mask[t])
        mx.eval(self._kept.weight, self._positions)

    def logits(self, hidden: mx.array) -> mx.array:
        """Full-width logits (..., V) from the kept rows alone."""
        kept = self._kept.project(hidden, self._quantized)
        floor = mx.full((*kept.shape[:-1], 1), LEFT_OUT_LOGIT, dtype=kept.dtype)
        return mx.take(mx.concatenate([kept, floor], axis=-1), self._positions, axis=-1)

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        return self.logits(self.inner.model(inputs, cache, **kwargs))

    def bind(self, owns: list[list[int]]) -> Any:
        """This draft scoring, for row i of a batch, the kept rows and `owns[i]` (row
        i's own tokens); itself when no row has any."""
        return OwnVocabView(self, owns) if any(owns) else self

    def __getattr__(self, name: str) -> Any:  # layers, make_cache, args, ...
        return getattr(self.inner, name)


class OwnVocabView:
    """A `ReducedVocabDraft` for one batch of rows, each also scoring its own tokens.

    The rows' own tokens are projected together (their union's head rows, gathered
    here), and each row's logits receive only its own columns: a token another row
    brought stays at the floor."""

    def __init__(self, draft: ReducedVocabDraft, owns: list[list[int]]) -> None:
        self.draft = draft
        union = sorted({t for own in owns for t in own})
        column = {t: i for i, t in enumerate(union)}
        width = max(len(own) for own in owns)
        columns, ids = [], []
        for own in owns:  # pad by repeating the row's first token (the same write twice)
            padded = own + own[:1] * (width - len(own)) if own else []
            columns.append([column[t] for t in padded] or [0] * width)
            ids.append(padded or [draft.left_out] * width)
        self._union = HeadRows.of(draft.head, mx.array(union, dtype=mx.int32))
        self._columns = mx.array(columns, dtype=mx.int32)
        self._ids = mx.array(ids, dtype=mx.int32)
        self._empty = mx.array([not own for own in owns])

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        hidden = self.draft.inner.model(inputs, cache, **kwargs)
        logits = self.draft.logits(hidden)  # (B, T, V)
        own = self._union.project(hidden, self.draft._quantized)  # (B, T, U)
        steps = logits.shape[1]
        columns = mx.broadcast_to(self._columns[:, None], (*own.shape[:2], self._columns.shape[1]))
        values = mx.take_along_axis(own, columns, axis=-1)
        values = mx.where(self._empty[:, None, None], LEFT_OUT_LOGIT, values).astype(logits.dtype)
        ids = mx.broadcast_to(self._ids[:, None], (logits.shape[0], steps, self._ids.shape[1]))
        return mx.put_along_axis(logits, ids, values, axis=-1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.draft, name)


def matches_full_head(reduced: ReducedVocabDraft, own: list[int]) -> bool:
    """Whether the reduced logits equal the model's own on the kept rows and on `own`
    (some ids left out), on a few tokens: false for a model that scales, caps or
    offsets logits after its head."""
    tokens = mx.array([reduced.kept[: min(8, len(reduced.kept))]], dtype=mx.int32)
    full = reduced.inner(tokens, cache=make_prompt_cache(reduced.inner))
    mine = reduced.bind([own])(tokens, cache=make_prompt_cache(reduced.inner))
    index = mx.array(reduced.kept + own, dtype=mx.int32)
    want = full[..., : reduced.vocab_rows][..., index].astype(mx.float32)
    got = mine[..., index].astype(mx.float32)
    scale = mx.maximum(mx.max(mx.abs(want)), 1.0)
    return bool(mx.max(mx.abs(want - got)) <= 1e-3 * scale)


def reduce_draft_vocab(model: Any, tokenizer: Any, rows: int | None) -> Any:
    """`model` drafting from `rows` frequent tokens (None = automatic: AUTO_ROWS when the
    vocabulary has more than AUTO_FROM, else all), or `model` itself where that would
    not help or the model's head is not a plain projection of its backbone."""
    head = output_head(model)
    if head is None or getattr(model, "model", None) is None or "weight" not in head:
        if rows:
            log.info("draft vocabulary kept whole: no plain output head found")
        return model
    vocab_rows = head["weight"].shape[0]
    if rows is None:
        rows = AUTO_ROWS if vocab_rows > AUTO_FROM else 0
    if rows <= 0 or rows >= vocab_rows:
        return model
    try:
        reduced = ReducedVocabDraft(model, kept_token_ids(tokenizer, rows, vocab_rows))
        left_out = [t for t in range(vocab_rows) if not reduced.kept_mask[t]]
        same = matches_full_head(reduced, left_out[:3])
    except (TypeError, ValueError, AttributeError, KeyError) as error:  # an unusual head
        log.info("draft vocabulary kept whole: its head cannot be cut (%s)", error)
        return model
    if not same:
        log.info("draft vocabulary kept whole: its logits are more than a projection")
        return model
    log.info(
        "draft proposes from %d of %d tokens (the first %d ids, the special tokens and "
        "each request's own)",
        len(reduced.kept),
        vocab_rows,
        rows,
    )
    return reduced


def vocabulary_of(model: Any) -> dict | None:
    """{"kept": rows scored for every request, "of": the vocabulary} of a reduced draft."""
    if isinstance(model, ReducedVocabDraft):
        return {"kept": len(model.kept), "of": model.vocab_rows, "own_per_request_max": MAX_OWN}
    return None


def describe_vocabulary(model: Any) -> str:
    """What a draft scores, in words (for start-up lines and bench output)."""
    vocabulary = vocabulary_of(model)
    if vocabulary is None:
        return "its whole vocabulary"
    return f"{vocabulary['kept']} of {vocabulary['of']} tokens and each request's own"


def bind_own(model: Any, owns: list[OwnTokens], contexts: list[list[int]]) -> Any:
    """`model` for rows with these contexts: a reduced draft bound to each row's own
    tokens (brought up to date with its context); any other model as it is."""
    if not isinstance(model, ReducedVocabDraft):
        return model
    ids = [own.update(ctx, model.kept_mask) for own, ctx in zip(owns, contexts, strict=True)]
    if len(owns) > 1:
        return model.bind(ids)
    own = owns[0]  # one stream: its view is kept until its tokens change
    if own.view is None or own.view[0] is not model:
        own.view = (model, model.bind(ids))
    return own.view[1]
