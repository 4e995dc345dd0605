"""Under `tandem serve --distributed`, a sequence's cache is named to the other ranks
(`CacheHandle`), which keep their shard of it under that name. A copy that shares the
arrays (`detached_copy`: a prompt checkpoint, a copy of a decoding request's cache for
the prefix cache) must take a name of its own and have the other ranks copy theirs:
under the same name, collecting either would drop the other ranks' cache of the one
still in use, and the next forward on it would fail every rank."""

from __future__ import annotations

import gc

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engines.cache.rollback import detached_copy
from engines.distributed.lockstep import (
    EDIT_COPY,
    EDIT_FREE,
    CacheHandle,
    _apply_edit,
    _Channel,
)


def filled(layer: KVCache, positions: int) -> KVCache:
    keys = mx.arange(positions * 4, dtype=mx.float32).reshape(1, 1, positions, 4)
    layer.update_and_fetch(keys, keys + 1)
    return layer


def test_a_named_caches_copy_takes_its_own_name_and_the_ranks_copy_theirs():
    channel = _Channel(group=None)
    handle = filled(CacheHandle(channel), 6)
    cache = [handle, filled(KVCache(), 6)]
    twin = detached_copy(cache)
    assert isinstance(twin[0], CacheHandle) and twin[0].handle_id != handle.handle_id
    assert list(channel.edits) == [(EDIT_COPY, 2, handle.handle_id, twin[0].handle_id)]
    # the arrays are shared values: the sequence going on does not reach the copy
    filled(handle, 2)
    assert handle.offset == 8 and twin[0].offset == 6
    assert mx.array_equal(twin[0].keys[..., :6, :], handle.keys[..., :6, :])
    assert not mx.any(twin[0].keys[..., 6:8, :]).item()  # the new positions are not in it
    assert mx.any(handle.keys[..., 6:8, :]).item()

    # another rank replays the edits: a copy under the new name, then only it is freed
    theirs = {handle.handle_id: [filled(KVCache(), 6)]}
    for kind, _, *args in channel.edits:
        _apply_edit(kind, args, theirs, model=None)
    assert set(theirs) == {handle.handle_id, twin[0].handle_id}
    channel.edits.clear()
    twin_id = twin[0].handle_id
    del twin
    gc.collect()
    assert list(channel.edits) == [(EDIT_FREE, 1, twin_id)]
    for kind, _, *args in channel.edits:
        _apply_edit(kind, args, theirs, model=None)
    assert set(theirs) == {handle.handle_id}  # the running sequence's cache is still there
