"""What a KV cache computed by a model is only valid for: the model's identity.

A prefix cache kept across restarts (scheduler/prefix_disk.py) must never hand a cache
to another model, another tokenizer or chat template (the same text would be other
tokens), another dtype, or another version of Tandem's file format. The identity is a
sha256 over all of these: every file of the model's folder by content (weights by a
full hash, remembered by path, size and mtime so a restart does not read gigabytes
again; config, tokenizer and chat template files as they are), the dtypes of the loaded
parameters, and `CACHE_FORMAT_VERSION`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from engines.model.cache_paths import file_sha256, remembered_sha256

# Bumped whenever what Tandem writes into a cache file, or what its caches mean, changes.
CACHE_FORMAT_VERSION = "tandem-prefix-1"
_LARGE = 16 << 20  # files above this are hashed through the memo (weights)


def folder_digest(folder: Path, memo_dir: Path) -> str:
    """sha256 over every file of `folder` (name and content hash), in name order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if path.name.startswith(".") or ".cache" in path.relative_to(folder).parts:
            continue  # hub download bookkeeping, editor files: not the model
        size = path.stat().st_size
        content = remembered_sha256(path, memo_dir) if size > _LARGE else file_sha256(path)
        digest.update(f"{path.relative_to(folder).as_posix()}\0{content}\n".encode())
    return digest.hexdigest()


def parameter_dtypes(model) -> str:
    """The dtypes the loaded model computes in (a folder can load as another dtype)."""
    from mlx.utils import tree_flatten

    return ",".join(sorted({str(v.dtype) for _, v in tree_flatten(model.parameters())}))


def model_identity(folder: Path, dtypes: str, memo_dir: Path, extra: str = "") -> str:
    """The identity of the model loaded from `folder`, as a hex sha256; `extra` holds
    settings that change its caches too (e.g. a draft model's vocabulary cut)."""
    parts = [CACHE_FORMAT_VERSION, folder_digest(folder, memo_dir), dtypes, extra]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
