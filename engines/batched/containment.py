"""Keeping a failure with its own rows: the batched engine's mutations all or nothing.

A join (rows entering a prefill group or the running batch), a prefill chunk and a
verify each change the batch's rows and caches. When one raises part-way, the batch
goes back to where it was before the change (or, for a prefill group whose caches a
failed forward left half-written, the group's rows leave it), and only the rows the
failure belongs to end: those a `RowFault` names, else every row of the failed
forward. They end with an error output each; every other row continues exactly as if
the failed step had not run. Across ranks (`--distributed`) nothing is contained: a
failed forward there most likely lost a rank, and the scheduler fails the server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engines.cache.ragged_cache import check_joinable
from engines.faults import RowFault
from engines.sequence import FinishReason, StepOutput

log = logging.getLogger(__name__)


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
