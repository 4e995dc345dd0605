"""Linux CPU: make sure MLX runs on a fast BLAS, re-executing ourselves if needed.

LD_PRELOAD only takes effect at process start, so when the bundled reference BLAS
is in use and OpenBLAS or MKL is on disk, we exec the same command line again with
it preloaded. A marker variable stops a second attempt.
"""

from __future__ import annotations

import logging
import os
import sys

from engines.platform.blas import find_fast_blas, loaded_fast_blas, needs_fast_blas

log = logging.getLogger("tandem")

REEXEC_MARKER = "TANDEM_BLAS_REEXEC"
FIX_HINT = (
    "install OpenBLAS (Debian/Ubuntu: apt-get install libopenblas0-pthread) or MKL "
    "(pip install mkl) and restart"
)


def ensure_fast_blas() -> None:
    if not needs_fast_blas():
        loaded = loaded_fast_blas()
        if loaded:
            log.info("fast BLAS loaded: %s", loaded)
        return
    if os.environ.get(REEXEC_MARKER):
        log.warning(
            "preloading %s did not take effect; MLX matmuls are ~40x slower. Fix: %s",
            os.environ.get("LD_PRELOAD"),
            FIX_HINT,
        )
        return
    path = find_fast_blas()
    if path is None:
        log.warning(
            "MLX is using its bundled reference BLAS (~40x slower matmuls). Fix: %s", FIX_HINT
        )
        return
    log.info("re-executing with fast BLAS preloaded: %s", path)
    preload = ":".join(p for p in (path, os.environ.get("LD_PRELOAD", "")) if p)
    env = {**os.environ, "LD_PRELOAD": preload, REEXEC_MARKER: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
