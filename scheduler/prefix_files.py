"""The file format of the prefix cache's disk tier: one entry, one safetensors file.

An entry is a list of cache layers (the target's, then the draft model's) holding
exactly `tokens`. Each layer is one of the cache classes Tandem serves (`CLASSES`: full
attention, sliding windows, recurrent state) and is written as its attributes, as
mlx-lm's `save_prompt_cache` writes a cache's `state`: arrays become tensors (bfloat16
as a uint16 view, its dtype kept in the spec) and everything else (offsets, window
sizes, per-row lengths, None) goes into a JSON spec, so any of these classes comes back
as it was. Full-attention keys and values are cut to the positions they hold.

`snapshot` runs on the engine thread (MLX streams are thread-local): it copies the
arrays to host memory, so the writer thread never touches MLX and the engine may go on
changing the caches. `encode` (writer thread) and `decode` (engine thread, at a hit)
are the file's two directions.

Header metadata (all strings): the format version, the model's and the draft model's
identity (`engines.model.identity`), a sha256 of the API-key scope (never the key),
the entry's kind and tokens, how many layers are the target's, the layer spec, and a
sha256 over all of it and every tensor, checked before an entry is used: a corrupt,
truncated or edited file raises `BadEntry`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from engines.cache.ragged_cache import RaggedKVCache
from engines.cache.ragged_recurrent import RaggedArraysCache
from engines.model.identity import CACHE_FORMAT_VERSION

CLASSES = {
    cls.__name__: cls
    for cls in (
        KVCache,
        RotatingKVCache,
        ArraysCache,
        ChunkedKVCache,
        RaggedKVCache,
        RaggedArraysCache,
    )
}
SUFFIX = ".safetensors"
# What `file_name` makes: the model's identity, the scope and the tokens, hashed.
ENTRY = re.compile(r"([0-9a-f]{16})-[0-9a-f]{16}-[0-9a-f]{24}\.safetensors")
_MAX_HEADER = 64 << 20


class BadEntry(ValueError):
    """A file that is not a whole, unedited entry of this format."""


class Unsupported(TypeError):
    """A cache this format cannot write (its entry stays in memory only)."""


@dataclass
class Snapshot:
    """An entry copied to host memory (numpy), ready for the writer thread."""

    tokens: list[int]
    scope: str  # sha256 of the API-key scope
    kind: str
    target_layers: int
    spec: list
    tensors: dict[str, np.ndarray]
    trimmable: bool

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass
class Header:
    """What the index keeps of a file without reading its tensors."""

    identity: str
    draft_identity: str
    scope: str
    kind: str
    tokens: list[int]
    target_layers: int
    trimmable: bool


def scope_hash(scope: str) -> str:
    return hashlib.sha256(f"tandem-prefix-scope\0{scope}".encode()).hexdigest()


def tokens_hash(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


def file_name(identity: str, scope: str, tokens: list[int]) -> str:
    """Named by hashes only: the model, the key's scope hash, the tokens."""
    return f"{identity[:16]}-{scope[:16]}-{tokens_hash(tokens)[:24]}{SUFFIX}"


# ---- engine thread ------------------------------------------------------------------


def snapshot(
    tokens: list[int], layers: list, scope: str, kind: str, target_layers: int
) -> Snapshot:
    """Copy `layers` to host memory; raises `Unsupported` for a cache of another class."""
    tensors: dict[str, np.ndarray] = {}
    spec = []
    for i, layer in enumerate(layers):
        name = type(layer).__name__
        if CLASSES.get(name) is not type(layer):
            raise Unsupported(f"cache class {type(layer).__qualname__} is not written to disk")
        fields = _fields(layer)
        spec.append({"class": name, "fields": _encode(fields, tensors, f"{i}")})
    trimmable = all(layer.is_trimmable() for layer in layers)
    return Snapshot(list(tokens), scope_hash(scope), kind, target_layers, spec, tensors, trimmable)


def decode(spec: list, tensors: dict[str, np.ndarray]) -> list:
    """The cache layers a file's spec and tensors describe (MLX arrays)."""
    layers = []
    for entry in spec:
        cls = CLASSES.get(entry.get("class"))
        if cls is None:
            raise BadEntry(f"unknown cache class {entry.get('class')!r}")
        layer = cls.__new__(cls)
        layer.__dict__.update(_decode(entry["fields"], tensors))
        layers.append(layer)
    return layers


def _fields(layer: Any) -> dict:
    """The layer's attributes, full-attention keys and values cut to what they hold."""
    fields = dict(vars(layer))
    if type(layer) is KVCache and layer.keys is not None:
        fields["keys"] = layer.keys[..., : layer.offset, :]
        fields["values"] = layer.values[..., : layer.offset, :]
    elif type(layer) is RaggedKVCache and layer.keys is not None:
        held = max(layer.columns)
        fields["keys"] = layer.keys[..., :held, :]
        fields["values"] = layer.values[..., :held, :]
    return fields


def _encode(value: Any, tensors: dict[str, np.ndarray], name: str) -> Any:
    if isinstance(value, mx.array):
        dtype = str(value.dtype).rsplit(".", 1)[-1]
        host = value.view(mx.uint16) if value.dtype == mx.bfloat16 else value
        tensors[name] = np.array(host, copy=True)
        return {"array": name, "dtype": dtype}
    if value is None or isinstance(value, bool | int | float | str):
        return {"value": value}
    if isinstance(value, list | tuple):
        items = [_encode(v, tensors, f"{name}.{i}") for i, v in enumerate(value)]
        return {"list": items, "tuple": isinstance(value, tuple)}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise Unsupported("a cache attribute dict with non-string keys")
        return {"dict": {k: _encode(v, tensors, f"{name}.{k}") for k, v in value.items()}}
    raise Unsupported(f"a cache attribute of type {type(value).__name__}")


def _decode(node: Any, tensors: dict[str, np.ndarray]) -> Any:
    if not isinstance(node, dict):
        raise BadEntry("malformed layer spec")
    if "array" in node:
        host = tensors[node["array"]]
        array = mx.array(host)
        return array.view(mx.bfloat16) if node["dtype"] == "bfloat16" else array
    if "value" in node:
        return node["value"]
    if "list" in node:
        items = [_decode(v, tensors) for v in node["list"]]
        return tuple(items) if node["tuple"] else items
    if "dict" in node:
        return {k: _decode(v, tensors) for k, v in node["dict"].items()}
    raise BadEntry("malformed layer spec")


# ---- writer thread / any thread (numpy and bytes only) ---------------------------------


def encode(entry: Snapshot, identity: str, draft_identity: str) -> bytes:
    """The file's bytes, checksum included."""
    metadata = {
        "format": CACHE_FORMAT_VERSION,
        "identity": identity,
        "draft_identity": draft_identity,
        "scope": entry.scope,
        "kind": entry.kind,
        "tokens": base64.b64encode(np.asarray(entry.tokens, dtype="<i4").tobytes()).decode(),
        "target_layers": str(entry.target_layers),
        "trimmable": "1" if entry.trimmable else "0",
        "spec": json.dumps(entry.spec, separators=(",", ":")),
    }
    metadata["sha256"] = _checksum(metadata, entry.tensors)
    return save_tensors(entry.tensors, metadata=metadata)


def read_header(path) -> Header:
    """A file's header alone (the index is rebuilt from these at start)."""
    try:
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise BadEntry("truncated header")
            (size,) = struct.unpack("<Q", prefix)
            if size > _MAX_HEADER:
                raise BadEntry("header too large")
            raw = handle.read(size)
        if len(raw) != size:
            raise BadEntry("truncated header")
        metadata = json.loads(raw).get("__metadata__") or {}
        return _header(metadata)
    except (OSError, ValueError, KeyError, TypeError) as error:
        if isinstance(error, BadEntry):
            raise
        raise BadEntry(f"unreadable header: {error}") from error


def read_entry(path) -> tuple[Header, list, dict[str, np.ndarray]]:
    """The header, layer spec and tensors of a whole file whose checksum matches."""
    try:
        data = Path(path).read_bytes()
        (size,) = struct.unpack("<Q", data[:8])
        metadata = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
        tensors = load_tensors(data)
    except BadEntry:
        raise
    except Exception as error:  # noqa: BLE001 - safetensors raises its own errors
        raise BadEntry(f"unreadable: {error}") from error
    expected = metadata.pop("sha256", None)
    if expected is None or _checksum(metadata, tensors) != expected:
        raise BadEntry("checksum mismatch")
    header = _header(metadata)
    try:
        spec = json.loads(metadata["spec"])
    except (KeyError, ValueError) as error:
        raise BadEntry(f"bad spec: {error}") from error
    return header, spec, tensors


def _header(metadata: dict) -> Header:
    if metadata.get("format") != CACHE_FORMAT_VERSION:
        raise BadEntry(f"format {metadata.get('format')!r}, not {CACHE_FORMAT_VERSION}")
    try:
        raw = base64.b64decode(metadata["tokens"], validate=True)
        tokens = np.frombuffer(raw, dtype="<i4").tolist()
        return Header(
            identity=metadata["identity"],
            draft_identity=metadata["draft_identity"],
            scope=metadata["scope"],
            kind=metadata["kind"],
            tokens=tokens,
            target_layers=int(metadata["target_layers"]),
            trimmable=metadata["trimmable"] == "1",
        )
    except (KeyError, ValueError, TypeError) as error:
        raise BadEntry(f"bad header field: {error}") from error


def _checksum(metadata: dict, tensors: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"\0{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        digest.update(array.reshape(-1).view(np.uint8))
    return digest.hexdigest()
