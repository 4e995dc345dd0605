"""Which BLAS a benchmarked server uses, so every result states it.

Tandem exports it (`tandem_blas_info{library}`); for other servers on this machine
(mlx_lm.server, vllm-mlx) the process listening on the port is found through
/proc and its memory map is read.
"""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path
from typing import Any

import httpx


def is_loopback(url: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1; a name other than localhost is not resolved."""
    host = httpx.URL(url).host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_blas(base_url: str, counters: dict | None) -> dict[str, Any]:
    """Which BLAS the server's process has mapped (Linux, loopback: found through the
    listening socket), or a `blas` label in its /metrics. On Linux CPU this is what
    decides matmul speed: OpenBLAS/MKL vs the wheel's ~40x slower reference BLAS."""
    for name, labels in counters or {}:
        named = dict(labels)
        if name.startswith("tandem_blas_info") and "library" in named:
            return {"blas": named["library"], "source": "/metrics tandem_blas_info"}
        if "blas" in named:
            return {"blas": named["blas"], "source": "/metrics"}
    if not is_loopback(base_url):
        return {"blas": "unknown", "source": "remote server"}
    if sys.platform == "darwin":
        return {"blas": "accelerate", "source": "macOS (MLX computes on Metal)"}
    if not sys.platform.startswith("linux"):
        return {"blas": "unknown", "source": sys.platform}
    url = httpx.URL(base_url)
    pid = listening_pid(url.port or (443 if url.scheme == "https" else 80))
    if pid is None:
        return {"blas": "unknown", "source": "server process not found"}
    return {**blas_of_process(pid), "server_pid": pid}


def listening_pid(port: int) -> int | None:
    """The process holding the TCP socket listening on `port` (same user only)."""
    inodes = listening_inodes(port)
    if not inodes:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(str(fd.readlink()) in targets for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue
    return None


def listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def blas_of_process(pid: int) -> dict[str, Any]:
    from engines.platform.blas import FAST_BLAS_PATTERN

    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError as exc:
        return {"blas": "unknown", "source": f"/proc/{pid}/maps: {exc.strerror}"}
    libraries = {line.split()[-1] for line in maps.splitlines() if "/" in line}
    # MLX's CUDA build computes on the GPU whatever BLAS is also mapped (numpy's, say):
    # the same "gpu" that Tandem's own startup line says there.
    if any("libcuda" in path or "libcudart" in path for path in libraries):
        return {"blas": "gpu", "library": None}
    fast = sorted(path for path in libraries if FAST_BLAS_PATTERN.search(path))
    if fast:
        return {"blas": "mkl" if "mkl" in fast[0] else "openblas", "library": fast[0]}
    if any("libmlx" in path for path in libraries):
        return {"blas": "reference", "library": None}
    return {"blas": "unknown", "library": None}
