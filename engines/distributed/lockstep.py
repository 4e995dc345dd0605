"""Lockstep: one sharded model served by several MLX processes (`mlx.launch`).

A tensor- or pipeline-sharded model runs collectives (all_sum, send/recv,
all_gather) inside every forward, so every rank must run the same forwards, with
the same input shapes, over caches that hold the same positions, in the same
order. Rank 0 runs everything else (HTTP, scheduler, engines, drafters, sampling);
the other ranks (`follow`) only repeat rank 0's target forwards on their shard.

How rank 0 tells them:
  * The target model is wrapped in `LockstepModel`. Before each forward it
    broadcasts a command: a fixed 4-int header, then a payload with the cache
    edits since the last forward, which cache the forward runs on, that cache's
    length, and the input tokens. A broadcast is an `all_sum` to which only rank 0
    contributes, on the same stream as the model's own collectives, so commands and
    forwards are ordered alike on every rank, and a token that is still being
    computed (a pipelined step) is broadcast without rank 0 waiting for it.
  * Caches are named by their first layer: a `CacheHandle` (a plain `KVCache` with
    an id) for one sequence, a `RaggedHandle` (a `RaggedKVCache` with an id) for the
    batched engine's rows. Followers keep one cache per id. What changes a cache's
    rows is recorded as an edit on its first layer and replayed on the follower's
    whole cache: copies (`copy.deepcopy`, as the prefix cache does), frees (a handle
    collected), and the batched engine's row moves (rows gathered from sequences,
    taken, filtered, appended, extracted back into a sequence).
  * Rollback needs no message: it only removes the newest positions, so a
    follower's cache always holds rank 0's positions plus perhaps some that rank 0
    has since rolled back; each forward carries the length of every row of its
    cache, and the follower cuts its copy to them first.
  * Every rank evaluates the backbone's output (the hidden state after the last
    collective) as soon as a forward is built, whatever the caller then evaluates:
    a prefill that evaluates only the cache would otherwise skip the last layer's
    collective on rank 0 while a follower waits in it.

Invariant: the n-th target forward on every rank has the same input and runs on
caches holding the same positions. The draft model and prompt lookup run on rank 0
only; they never touch the sharded model.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
from collections import deque
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

from engines.cache.ragged_cache import RaggedKVCache, ragged_from_rows
from engines.distributed.rank_watch import RankWatch

log = logging.getLogger(__name__)

HEADER_SIZE = 4
OP_FORWARD, OP_STOP = 1, 2
# Edits: [kind, count, *arguments]; see `_apply_edit` for each kind's arguments.
EDIT_COPY, EDIT_FREE, EDIT_GATHER, EDIT_TAKE, EDIT_FILTER, EDIT_EXTEND, EDIT_EXTRACT = range(1, 8)
NO_CACHE = -1


class LockstepError(RuntimeError):
    """Ranks disagree about a cache: the lockstep invariant is broken."""


class CacheHandle(KVCache):
    """A target cache's first layer: a plain `KVCache` that names the cache to the
    followers. Copies get a new name and tell the followers to copy theirs; a handle
    that is collected tells them to drop theirs."""

    plain_kv = True  # trims and cuts back as a KVCache (engines.cache.rollback.plain_kv)

    def __init__(self, channel: _Channel) -> None:
        super().__init__()
        self._channel = channel
        self.handle_id = next(channel.ids)

    def __deepcopy__(self, memo: dict) -> CacheHandle:
        twin = CacheHandle(self._channel)
        for name, value in self.__dict__.items():
            if name not in ("_channel", "handle_id"):
                setattr(twin, name, copy.deepcopy(value, memo))
        self._channel.record(EDIT_COPY, self.handle_id, twin.handle_id)
        return twin

    def __copy__(self) -> CacheHandle:
        """A twin sharing these arrays under a name of its own (`detached_copy`: a
        checkpoint, a copy for the prefix cache), whose followers copy theirs: under the
        same name, whichever of the two was collected first would drop the followers'
        cache of the other."""
        twin = CacheHandle(self._channel)
        for name, value in self.__dict__.items():
            if name not in ("_channel", "handle_id"):
                setattr(twin, name, value)
        self._channel.record(EDIT_COPY, self.handle_id, twin.handle_id)
        return twin

    def ragged_from(self, caches: list[KVCache]) -> RaggedHandle:
        """The first layer of the batched cache gathered from `caches` (this one's
        sequence and others'), named too."""
        if not all(isinstance(c, CacheHandle) for c in caches):
            raise LockstepError("a batch of sequences mixes named and unnamed caches")
        gathered = RaggedKVCache.from_caches(caches)
        ragged = RaggedHandle(self._channel, gathered.lengths, gathered.keys, gathered.values)
        self._channel.record(EDIT_GATHER, ragged.handle_id, *(c.handle_id for c in caches))
        return ragged

    def __del__(self) -> None:
        _tell_freed(self)


class RaggedHandle(RaggedKVCache):
    """A batched cache's first layer: a `RaggedKVCache` with an id, whose row moves
    are recorded for the followers (rollback of rows needs no record: see above)."""

    def __init__(self, channel: _Channel, lengths: list[int], keys=None, values=None) -> None:
        super().__init__(lengths, keys, values)
        self._channel = channel
        self.handle_id = next(channel.ids)

    def take(self, rows: list[int]) -> RaggedHandle:
        taken = super().take(rows)
        twin = RaggedHandle(self._channel, taken.lengths, taken.keys, taken.values)
        self._channel.record(EDIT_TAKE, self.handle_id, twin.handle_id, *rows)
        return twin

    def filter(self, rows: list[int]) -> None:
        super().filter(rows)
        self._channel.record(EDIT_FILTER, self.handle_id, *rows)

    def extend(self, other: RaggedKVCache) -> None:
        if not isinstance(other, RaggedHandle):
            raise LockstepError("a named batched cache can only grow by named rows")
        super().extend(other)
        self._channel.record(EDIT_EXTEND, self.handle_id, other.handle_id)

    def extract(self, row: int) -> CacheHandle:
        plain = super().extract(row)
        handle = CacheHandle(self._channel)
        handle.keys, handle.values, handle.offset = plain.keys, plain.values, plain.offset
        self._channel.record(EDIT_EXTRACT, self.handle_id, row, handle.handle_id)
        return handle

    def __del__(self) -> None:
        _tell_freed(self)


def _tell_freed(handle: CacheHandle | RaggedHandle) -> None:
    try:
        handle._channel.record(EDIT_FREE, handle.handle_id)
    except Exception:  # noqa: BLE001 - interpreter shutdown: nobody to tell
        pass


class _Channel:
    """Rank 0's side of the command stream: handle ids and edits not yet sent."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.ids = itertools.count()
        # Appended from any thread (a handle may be collected anywhere); drained by the
        # engine thread before each forward.
        self.edits: deque[tuple[int, ...]] = deque()

    def record(self, kind: int, *arguments: int) -> None:
        self.edits.append((kind, len(arguments), *arguments))

    def broadcast(self, values: mx.array) -> None:
        """Send `values` (int32) to every rank; runs in stream order, unwaited."""
        mx.async_eval(mx.distributed.all_sum(values, group=self.group))

    def take_edits(self) -> tuple[int, list[int]]:
        """How many edits are pending, and all of them, flat."""
        count, flat = 0, []
        while self.edits:
            flat.extend(self.edits.popleft())
            count += 1
        return count, flat


def _receive(size: int, group: mx.distributed.Group) -> list[int]:
    received = mx.distributed.all_sum(mx.zeros((size,), dtype=mx.int32), group=group)
    return received.tolist()


class _EvaluatedBackbone:
    """The model's backbone, whose output is scheduled for evaluation as soon as it is
    built, so its collectives run on every rank whatever the caller evaluates."""

    def __init__(self, backbone: Any) -> None:
        self._backbone = backbone

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hidden = self._backbone(*args, **kwargs)
        mx.async_eval(hidden)
        return hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backbone, name)


def prepare_for_lockstep(model: Any) -> None:
    """Make a sharded model safe to run in lockstep, on every rank: its backbone
    (mlx-lm's `model.model`) is wrapped in `_EvaluatedBackbone`, and a model whose
    output head is itself sharded is refused (its collective would run only where the
    logits are evaluated). The parameter tree keeps the original backbone: the
    wrapper is set as a plain attribute, which attribute lookup finds first."""
    backbone = getattr(model, "model", None)
    if backbone is None:
        raise LockstepError(f"{type(model).__name__} has no .model backbone to run in lockstep")
    head = type(getattr(model, "lm_head", None)).__name__
    if "Sharded" in head:
        raise LockstepError(f"{type(model).__name__} shards its output head ({head})")
    if not isinstance(backbone, _EvaluatedBackbone):
        object.__setattr__(model, "model", _EvaluatedBackbone(backbone))


class LockstepModel:
    """Rank 0's target model: broadcasts each forward to the followers, then runs it."""

    def __init__(self, model: Any, group: mx.distributed.Group) -> None:
        prepare_for_lockstep(model)
        self._model = model
        self._channel = _Channel(group)
        self.ranks = group.size()
        self.watch = RankWatch(group)  # every follower joins it right after loading

    def make_cache(self) -> list:
        """The model's own cache list, its first layer replaced by a `CacheHandle`."""
        layers = make_prompt_cache(self._model)
        if not layers or any(type(layer) is not KVCache for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers})
            raise LockstepError(f"lockstep serving needs plain KV caches, this model has {kinds}")
        return [CacheHandle(self._channel), *layers[1:]]

    def __call__(self, inputs: mx.array, cache: list | None = None, **kwargs: Any) -> Any:
        if kwargs:
            raise LockstepError(f"lockstep forwards take tokens and a cache only, not {kwargs}")
        if inputs.ndim != 2:
            raise LockstepError(f"lockstep forwards take [batch, tokens], got {inputs.shape}")
        if cache is None:
            handle_id, lengths = NO_CACHE, []
        elif isinstance(cache[0], CacheHandle):
            handle_id, lengths = cache[0].handle_id, [cache[0].offset]
        elif isinstance(cache[0], RaggedHandle):
            handle_id, lengths = cache[0].handle_id, cache[0].lengths
        else:
            raise LockstepError("a lockstep forward needs a cache made by make_cache()")
        count, edits = self._channel.take_edits()
        head = [count, *edits, handle_id, len(lengths), *lengths, *inputs.shape]
        payload = mx.concatenate(
            [mx.array(head, dtype=mx.int32), inputs.reshape(-1).astype(mx.int32)]
        )
        self._channel.broadcast(mx.array([OP_FORWARD, payload.size, 0, 0], dtype=mx.int32))
        self._channel.broadcast(payload)
        return self._model(inputs, cache=cache)

    def stop_followers(self) -> None:
        """Tell every follower to return from `follow`; the last command sent."""
        self._channel.broadcast(mx.array([OP_STOP, 0, 0, 0], dtype=mx.int32))
        mx.synchronize()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def follow(model: Any, group: mx.distributed.Group) -> int:
    """A follower rank's loop: repeat rank 0's forwards until it says stop. Returns
    how many forwards ran. Raises if the ranks' caches disagree, or (from MLX) when a
    peer is lost."""
    caches: dict[int, list] = {}
    forwards = 0
    while True:
        op, size, _, _ = _receive(HEADER_SIZE, group)
        if op == OP_STOP:
            log.info("rank %d: rank 0 stopped after %d forwards", group.rank(), forwards)
            return forwards
        if op != OP_FORWARD:
            raise LockstepError(f"unknown lockstep command {op}")
        payload = _receive(size, group)
        position, count = 1, payload[0]
        for _ in range(count):
            kind, arguments = payload[position], payload[position + 1]
            _apply_edit(kind, payload[position + 2 : position + 2 + arguments], caches, model)
            position += 2 + arguments
        handle_id, rows = payload[position : position + 2]
        lengths = payload[position + 2 : position + 2 + rows]
        batch, length = payload[position + 2 + rows : position + 4 + rows]
        tokens = mx.array(payload[position + 4 + rows :], dtype=mx.int32).reshape(batch, length)
        cache = None if handle_id == NO_CACHE else _cut_to(caches, handle_id, lengths, model)
        mx.eval(model.model(tokens, cache=cache))
        forwards += 1


def _apply_edit(kind: int, args: list[int], caches: dict[int, list], model: Any) -> None:
    """Replay one of rank 0's cache edits on this rank's caches."""
    known = functools.partial(_cache, caches, model=model)
    if kind == EDIT_COPY:  # source, copy
        caches[args[1]] = copy.deepcopy(known(args[0]))
    elif kind == EDIT_FREE:  # handle
        caches.pop(args[0], None)
    elif kind == EDIT_GATHER:  # batched cache, its rows' sequence caches...
        caches[args[0]] = ragged_from_rows([known(source) for source in args[1:]])
    elif kind == EDIT_TAKE:  # source, new, rows...
        caches[args[1]] = [layer.take(args[2:]) for layer in caches[args[0]]]
    elif kind == EDIT_FILTER:  # batched cache, rows kept...
        for layer in caches[args[0]]:
            layer.filter(args[1:])
    elif kind == EDIT_EXTEND:  # batched cache, the one whose rows it appends
        for layer, other in zip(caches[args[0]], caches[args[1]], strict=True):
            layer.extend(other)
    elif kind == EDIT_EXTRACT:  # batched cache, row, new sequence cache
        caches[args[2]] = [layer.extract(args[1]) for layer in caches[args[0]]]
    else:
        raise LockstepError(f"unknown cache edit {kind}")


def _cache(caches: dict[int, list], handle_id: int, model: Any) -> list:
    """This rank's copy of cache `handle_id`. One rank 0 made but never ran a forward
    on (nor edited) is unknown here: it is empty, as it is there."""
    if handle_id not in caches:
        caches[handle_id] = make_prompt_cache(model)
    return caches[handle_id]


def _cut_to(caches: dict[int, list], handle_id: int, lengths: list[int], model: Any) -> list:
    """This rank's copy of cache `handle_id`, its rows cut to rank 0's `lengths`."""
    cache = _cache(caches, handle_id, model)
    if isinstance(cache[0], RaggedKVCache):
        if list(cache[0].lengths) != lengths:
            for layer in cache:
                layer.set_lengths(lengths)  # raises if rank 0 holds more than this rank
        return cache
    excess = cache[0].offset - lengths[0]
    if excess < 0:
        raise LockstepError(
            f"cache {handle_id} holds {cache[0].offset} positions here, rank 0 has {lengths[0]}"
        )
    if excess:
        trim_prompt_cache(cache, excess)
    return cache


def load_shard(folder: str, mode: str, group: mx.distributed.Group) -> tuple[Any, Any, dict]:
    """This rank's shard of the model in `folder`, through mlx-lm's `sharded_load`
    (`mode` is "tensor" or "pipeline"; which model families support which is
    mlx-lm's), made ready for lockstep. Every rank must call it: it ends in a
    barrier."""
    from mlx_lm.utils import sharded_load

    if mode not in ("tensor", "pipeline"):
        raise ValueError(f"--distributed must be tensor or pipeline, not {mode!r}")
    groups = {"pipeline_group": group} if mode == "pipeline" else {"tensor_group": group}
    model, tokenizer, config = sharded_load(folder, return_config=True, **groups)
    prepare_for_lockstep(model)
    return model, tokenizer, config


def distributed_group() -> mx.distributed.Group:
    """The group `mlx.launch` set up; refuses a run that was not launched with it."""
    group = mx.distributed.init()
    if group.size() < 2:
        raise SystemExit(
            "tandem serve --distributed: this process is alone (rank 0 of 1). Launch every "
            "rank with MLX's launcher, e.g. `mlx.launch --backend ring --hosts "
            "host1,host2 -- tandem serve MODEL --distributed tensor` (deploy/README.md)"
        )
    return group
