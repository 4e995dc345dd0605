"""A follower rank's whole life under `tandem serve --distributed`: load its shard of
the model, repeat rank 0's forwards (`engines.distributed.lockstep.follow`) until rank 0 stops,
exit. It serves no HTTP and decides nothing.

Signals: `mlx.launch` passes SIGTERM/SIGINT to every rank, but rank 0 first drains
its in-flight requests, which needs this rank's shard. So a follower outlives the
signal by rank 0's drain (plus a margin) and leaves when rank 0 says stop, or when
the ring breaks because rank 0 is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from engines.distributed.lockstep import distributed_group, follow, load_shard
from engines.distributed.rank_watch import join_watch
from engines.model.registry import model_folder
from scheduler.config import SchedulerConfig

log = logging.getLogger(__name__)

EXIT_MARGIN_S = 10.0


def follower_rank() -> int:
    """This process's rank among the launched ones (0 serves)."""
    return distributed_group().rank()


def run_follower(config: SchedulerConfig, rank: int, shutdown_timeout: float) -> None:
    group = distributed_group()
    deadline = shutdown_timeout + EXIT_MARGIN_S

    def outlive_signal(sig: int, _frame) -> None:
        log.info("rank %d: %s; leaving with rank 0, or in %.0fs", rank, sig, deadline)
        timer = threading.Timer(deadline, os._exit, args=(1,))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, outlive_signal)
    signal.signal(signal.SIGINT, outlive_signal)
    log.info(
        "rank %d of %d: loading %s (%s parallel)",
        rank,
        group.size(),
        config.model,
        config.distributed,
    )
    model, _, _ = load_shard(
        model_folder(config.model, config.gguf_dtype), config.distributed, group
    )
    watched = join_watch(group)  # closes with this process: rank 0 then knows at once
    log.info("rank %d: following rank 0", rank)
    try:
        forwards = follow(model, group)
    except RuntimeError as exc:  # MLX's ring: rank 0 (or a neighbour) is gone
        raise SystemExit(f"tandem serve: rank {rank}: {exc}") from exc
    log.info("rank %d: stopped after %d forwards", rank, forwards)
    if watched is not None:
        watched.close()
