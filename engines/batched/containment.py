"""Keeping a failure with its own rows: the batched engine's mutations all or nothing.

A join (rows entering a prefill group or the running batch), a prefill chunk and a
verify each change the batch's rows and caches. When one raises part-way, the batch
goes back to where it was before the change (or, for a prefill group whose caches a
failed forward left half-written, the group's rows leave it), and only the rows the
failure belongs to end: those a `RowFault` names, else every row of the failed
forward. They end with an error output each; every other row continues exactly as if
the failed step had not run. Across ranks (`--distributed`) nothing is contained: a
failed forward there most likely lost a rank, and the scheduler fails the server.

Drafting is the exception: a draft only proposes and the verify decides, so a failed
draft fails no request. The rows it belongs to stop drafting with the drafter that
failed (its gate goes; a model drafter's state for them is dropped, as it may be what
broke), no row keeps that drafter's drafts of the failed step, and every row goes on
with exactly the tokens it would have committed anyway. Drafters run on rank 0 alone,
so this holds across ranks too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from engines.cache.ragged_cache import check_joinable
from engines.drafting.draft import DRAFT
from engines.faults import RowFault
from engines.sequence import FinishReason, StepOutput

log = logging.getLogger(__name__)


class ModelDrafterRows(Protocol):
    """What containment asks of a batched model drafter (`DraftModelRows`, `BatchedMTP`);
    named here so this module imports neither (they import it)."""

    method: str

    def drafting_rows(self, rows: list[Any]) -> list[int]: ...

    def recover(self, cache: list, rows: list[Any], failed: list[int]) -> None: ...


def involved(exc: BaseException, rows: list) -> list[int]:
    """Indices of the rows a failure belongs to: those a `RowFault` names, else all."""
    if isinstance(exc, RowFault):
        named = set(exc.request_ids)
        return [i for i, row in enumerate(rows) if row.seq.request_id in named]
    return list(range(len(rows)))


def failed_outputs(rows: list, exc: BaseException, where: str) -> list[StepOutput]:
    """An error output for each row (which has left the batch); logged once."""
    ids = [row.seq.request_id for row in rows]
    log.error("%s failed for %s; the other rows go on", where, ", ".join(ids), exc_info=exc)
    outputs = []
    for row in rows:
        row.seq.finish_reason = FinishReason.ERROR
        outputs.append(StepOutput(row.seq.request_id, [], "", FinishReason.ERROR, error=str(exc)))
    return outputs


def join_rows(
    rows: list, layers: list, new_rows: list, extra: list, hook: Callable[[], None]
) -> None:
    """Append `new_rows` to `rows` and their cache rows (`extra`, layer for layer) to
    `layers`, all or nothing: pairs are checked first, and if extending a layer or
    `hook` (called between the caches' change and the rows') raises, the layers
    already extended are cut back to their own rows and `rows` is unchanged."""
    check_joinable(layers, extra)
    count = len(rows)
    extended = []
    try:
        for layer, more in zip(layers, extra, strict=True):
            layer.extend(more)
            extended.append(layer)
        hook()
    except BaseException:
        for layer in extended:
            layer.filter(list(range(count)))
        raise
    rows.extend(new_rows)


def stop_drafting(rows: list[Any], method: str, exc: BaseException, where: str) -> None:
    """The rows draft no more with `method` (its gate goes, counted as a `failure` trip
    in each request's stats): a drafter that failed on a row may fail again, or propose
    from a state the failure left half-changed; the rows go on without it. Logged once."""
    ids = ", ".join(row.seq.request_id for row in rows) or "no row"
    log.error("%s failed for %s; they go on without it", where, ids, exc_info=exc)
    for row in rows:
        if row.drafting.gates.pop(method, None) is not None:
            row.seq.spec.trip("failure")


def contain_draft_failure(
    drafter: ModelDrafterRows, cache: list, rows: list[Any], exc: BaseException
) -> None:
    """The model drafter's batched draft raised: the rows it belongs to -- those a
    `RowFault` names, else every row its forwards fed (one forward over all: no row to
    blame) -- stop drafting with it for good, every other row's drafter state goes back
    to where it was consistent (`drafter.recover`), and no row keeps a model draft this
    step (each verifies its lookup draft, or none)."""
    fed = drafter.drafting_rows(rows)
    failed = [fed[i] for i in involved(exc, [rows[j] for j in fed])]
    drafter.recover(cache, rows, failed)
    for row in rows:
        if row.method == drafter.method:
            row.method, row.drafts, row.probs, row.draft_length = None, [], None, 0
    where = f"a batched draft by the {drafter.method} drafter"
    stop_drafting([rows[i] for i in failed], DRAFT, exc, where)
