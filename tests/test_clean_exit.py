"""A process that ran the engine thread exits cleanly.

MLX gives each thread its own streams, each with a C++ worker thread. Left to static
destruction at interpreter exit they abort the process now and then ("terminate called
without an active exception", exit -6): about one exit in ten before the engine thread
learned to destroy its streams itself. One trial proves little, so this runs many fresh
processes, each streaming part of a request and cancelling it mid-flight (the pipelined
step is still queued) before stopping.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engines.platform.blas import find_fast_blas

TRIALS = 16

SCRIPT = """
import asyncio, sys
from engines.gating.measured_costs import CostModel
from engines.request import GenerationRequest
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler

async def main(model):
    scheduler = Scheduler(SchedulerConfig(model=model, cost_model=CostModel.assumed(9)))
    scheduler.start()
    assert scheduler.wait_loaded(60), scheduler.error
    request = GenerationRequest(request_id="r", prompt_tokens=(1, 2, 3, 4), max_tokens=500)
    received = 0
    async for _ in scheduler.submit(request):
        received += 1
        if received == 5:
            break
    scheduler.stop()

asyncio.run(main(sys.argv[1]))
print("exiting")
"""


def run_trial(model_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    blas = find_fast_blas()
    if blas:
        env["LD_PRELOAD"] = str(blas)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.slow
def test_engine_thread_processes_exit_zero_without_abort(tiny_model_dir):
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run_trial, [tiny_model_dir] * TRIALS))
    for result in results:
        assert "exiting" in result.stdout, result.stderr
        assert "terminate called" not in result.stderr
        assert result.returncode == 0, result.stderr
