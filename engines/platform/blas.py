"""Which BLAS MLX's CPU backend is using, and where a fast one could come from.

The `mlx[cpu]` wheel bundles a reference BLAS that is ~40x slower than OpenBLAS or
MKL on matmuls. Preloading a fast BLAS (LD_PRELOAD) makes MLX's `cblas_sgemm`
resolve to it. These helpers only look; the CLI decides whether to re-exec.
"""

from __future__ import annotations

import glob
import os
import re
import sys
import sysconfig
from pathlib import Path

FAST_BLAS_PATTERN = re.compile(r"(libopenblas[^/\s]*\.so[^/\s]*|libmkl_rt[^/\s]*\.so[^/\s]*)")

_OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def loaded_fast_blas() -> str | None:
    """Path of a fast BLAS mapped into this process, if any (Linux only)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        match = FAST_BLAS_PATTERN.search(line)
        if match:
            return line.split()[-1]
    return None


def find_fast_blas(preference: str | None = None) -> str | None:
    """A fast BLAS on disk that could be preloaded: OpenBLAS (apt) first, then MKL (the
    `mkl` wheel, a dependency on x86_64 Linux, so a fresh venv has one without apt).
    `TANDEM_BLAS=mkl` (or `openblas`) puts that one first."""
    preference = preference or os.environ.get("TANDEM_BLAS", "auto")
    openblas = [path for path in _OPENBLAS_CANDIDATES if os.path.exists(path)]
    mkl = _pip_mkl()
    ordered = [*mkl, *openblas] if preference == "mkl" else [*openblas, *mkl]
    return ordered[0] if ordered else None


def _pip_mkl() -> list[str]:
    prefixes = {sys.prefix, sysconfig.get_config_var("prefix") or sys.prefix}
    return [
        path
        for prefix in sorted(prefixes)
        for path in sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
    ]


def computes_on_cpu() -> bool:
    """MLX's default device is the CPU: the only case where the BLAS sets the speed."""
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def describe_blas() -> str:
    """One word for logs and metrics: accelerate, openblas, mkl, reference or gpu."""
    if sys.platform == "darwin":
        return "accelerate"
    if not computes_on_cpu():
        return "gpu"
    loaded = loaded_fast_blas()
    if loaded is None:
        return "reference"
    return "mkl" if "mkl" in loaded else "openblas"


def needs_fast_blas() -> bool:
    """True on Linux when MLX computes on the CPU with the bundled reference BLAS."""
    if not sys.platform.startswith("linux"):
        return False
    return computes_on_cpu() and loaded_fast_blas() is None
