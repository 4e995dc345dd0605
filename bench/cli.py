"""`tandem bench ...`: the benchmark commands.

tandem bench spec MODEL ...     in-process speculative speed-up suite (bench/spec.py)
tandem bench single ...         one server process vs mlx-lm, single stream
tandem bench grammar MODEL      per-token cost of --tool-call-grammar auto
tandem bench ceiling MODEL      the most prompt lookup could gain in a batch (an oracle bound)
tandem bench draft-ceiling MODEL --draft-model D   what draft length policies can gain, one stream
tandem bench distributed MODEL  one model over mlx.launch ranks vs one process, and mlx_lm's
tandem bench rollback MODEL     verify and rollback cost vs a plain step (recurrent, windowed)
tandem bench invariance [MODEL] verify vs plain logits on this device, per dtype (exactness)
tandem bench device [--dry-run] the prepared GPU check vs mlx_lm.server (bench/device_check.sh)
tandem bench agent [--short]    recorded agent sessions vs mlx_lm.server at 1, 2, 4 sessions
tandem bench prefill-sharing MODEL  a stream's gaps while a long prompt prefills (issue 42)
tandem bench outside [--model M]  guidellm against tandem serve and mlx_lm.server (issue 55)
tandem bench vision [MODEL]     image-prompt TTFT, cold and cached, vs mlx_vlm.server
"""

from __future__ import annotations

import os
import sys

# commands that run MLX in this process: like `tandem serve`, they re-exec with a fast
# BLAS preloaded on Linux CPU (TANDEM_NO_BLAS_PRELOAD=1 keeps the BLAS as it is)
IN_PROCESS = {
    "spec",
    "single",
    "grammar",
    "ceiling",
    "draft-ceiling",
    "rollback",
    "invariance",
    "agent",
    "prefill-sharing",
}


def main(argv: list[str]) -> None:
    commands = {
        "spec": "bench.spec",
        "hybrid": "bench.hybrid",
        "soak": "bench.soak",
        "single": "bench.single_stream",
        "serve": "bench.serve",
        "plot": "bench.plot",
        "grammar": "bench.grammar_cost",
        "ceiling": "bench.ceiling",
        "draft-ceiling": "bench.draft_ceiling",
        "distributed": "bench.distributed",
        "rollback": "bench.rollback_cost",
        "invariance": "bench.batch_invariance",
        "device": "bench.device",
        "agent": "bench.agent",
        "prefill-sharing": "bench.prefill_sharing",
        "outside": "bench.outside_harness",
        "vision": "bench.vision",
    }
    if not argv or argv[0] not in commands:
        print(__doc__)
        raise SystemExit(2)
    if argv[0] in IN_PROCESS and not os.environ.get("TANDEM_NO_BLAS_PRELOAD"):
        from engines.platform.blas_preload import ensure_fast_blas

        ensure_fast_blas()
    module = __import__(commands[argv[0]], fromlist=["main"])
    sys.argv = [f"tandem bench {argv[0]}", *argv[1:]]
    module.main(argv[1:]) if _takes_argv(module.main) else module.main()


def _takes_argv(function) -> bool:
    import inspect

    return bool(inspect.signature(function).parameters)
