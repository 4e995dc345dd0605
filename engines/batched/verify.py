"""A batched verify's log-probabilities and each row's exact acceptance.

One target forward scores `[B, 1 + K]`; row i fed its newest token and its drafts
(`fed_rows[i]`, shorter rows padded at the end). Row i's positions are processed with
exactly the history a plain step would have seen (penalties, bias, grammar), and its
drafts are accepted by the rule for its sampling settings: greedy -- while the draft
equals the argmax; seeded -- while it equals the plain seeded sample at that output
position; otherwise Leviathan's rejection rule with the row's own RNG. So every row
commits what plain decoding of that request alone would (token for token, or in
distribution), whatever the other rows are.
"""

from __future__ import annotations

import logging

import mlx.core as mx

from engines.batched.drafting import BatchRow
from engines.sample.acceptance import accept_greedy
from engines.sample.logprobs import token_logprobs
from engines.sample.sampling import coupled_tokens, sample_token
from engines.sample.verify import accept_sampled_draft, processed_logits
from engines.sequence import FinishReason, StepOutput

log = logging.getLogger(__name__)


def process_rows(batch: list[BatchRow], logits: mx.array, fed_rows: list[list[int]]) -> mx.array:
    """Log-probabilities per row and position, after that row's processors with
    exactly the history a plain step would have seen."""
    if any(row.seq.processors for row in batch):
        logits = mx.stack(
            [
                processed_logits(
                    logits[i], mx.array(row.tokens[:-1], dtype=mx.int32), fed, row.seq.processors
                )
                for i, (row, fed) in enumerate(zip(batch, fed_rows, strict=True))
            ]
        )
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def accept_rows(
    batch: list[BatchRow], logprobs: mx.array, fed_rows: list[list[int]]
) -> list[tuple[int, int]]:
    """(accepted drafts, next token) per row: greedy rows from one batched argmax,
    sampled rows by the rejection rule with their own settings and RNG."""
    argmax = mx.argmax(logprobs, axis=-1)
    coupled, pending = {}, {}
    for i, (row, fed) in enumerate(zip(batch, fed_rows, strict=True)):
        params, rng = row.seq.request.sampling, row.seq.rng
        position = len(row.seq.generated)
        if params.greedy:
            continue
        if rng.seeded:  # plain seeded samples per position, coupled with the drafts
            coupled[i] = coupled_tokens(params, logprobs[i, : len(fed)], rng, position)
            continue
        drafts = fed[1:]
        if not drafts:
            pending[i] = (None, sample_token(params, logprobs[i, :1], rng, position))
            continue
        pending[i] = accept_sampled_row(row, logprobs[i, : len(fed)], drafts)
    lazy = [x for pair in pending.values() for x in pair if x is not None]
    mx.eval(argmax, *coupled.values(), *lazy)
    targets = argmax.tolist()
    for i, tokens in coupled.items():
        targets[i] = tokens.tolist()
    decisions = []
    for i, fed in enumerate(fed_rows):
        if i in pending:
            accepted, token = pending[i]
            decisions.append((0 if accepted is None else int(accepted.item()), int(token.item())))
        else:
            accepted = accept_greedy(targets[i], fed[1:])
            decisions.append((accepted, targets[i][accepted]))
    return decisions


def accept_sampled_row(row: BatchRow, logprobs: mx.array, drafts: list[int]):
    """Leviathan's rule for one sampled row: (accepted, next token), lazy."""
    seq = row.seq
    return accept_sampled_draft(seq.request.sampling, seq.rng, logprobs, drafts, row.probs)


def commit_row(row: BatchRow, committed: list[int], logprobs: mx.array) -> StepOutput:
    """Commit a row's accepted tokens (stopping where its sequence finishes) and their
    logprobs if asked; a commit that raises fails this row only, not the batch."""
    seq = row.seq
    text = []
    try:
        for token in committed:
            text.append(seq.commit(token))
            if seq.finished:
                break
    except Exception as exc:  # noqa: BLE001 - fail this sequence, keep the batch
        log.exception("request %s failed in the batched engine", seq.request_id)
        seq.finish_reason = FinishReason.ERROR
        return StepOutput(seq.request_id, [], "", FinishReason.ERROR, error=str(exc))
    tokens = committed[: len(text)]
    output = StepOutput(seq.request_id, tokens, "".join(text), seq.finish_reason, seq.matched_stop)
    if seq.request.logprobs is not None:
        output.logprobs = token_logprobs(logprobs[: len(tokens)], tokens, seq.request.logprobs)
    return output
