"""The prefix cache's disk tier: a restart (a new scheduler over the same directory)
serves a prompt that extends a stored one from disk, with output identical to a cold
prefill; entries stay within their API key; a corrupt, truncated or foreign file is
dropped and logged, never loaded; the bound in bytes evicts the least recently used;
files are private (0600, in a 0700 folder of the tier's own); sliding-window and
recurrent caches come back through their prompt checkpoints; the draft model's cache
comes back beside the target's. (What the tier owns in a folder it shares, and the
API-key scopes it keeps across restarts: tests/test_prefix_folder.py,
tests/test_prefix_disk_keys.py.)"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from engines.drafting.draft_model import DraftState
from engines.request import GenerationRequest, SamplingParams
from scheduler.prefix_cache import PrefixCache
from scheduler.prefix_disk import MIN_TOKENS, DiskTier
from scheduler.prefix_files import SUFFIX
from scheduler.prefix_folder import SUBFOLDER
from tests.conftest import Reference, make_client, start_scheduler
from tests.tiny_archs import build_tiny_arch

STORY = "Once upon a time there was a little robot who liked to read about the sea. "
MORE = " And then the robot went home."


def long_prompt(tokenizer, text: str = STORY, repeat: int = 24) -> list[int]:
    ids = tokenizer.encode(text * repeat)
    assert len(ids) > MIN_TOKENS
    return ids


def disk_scheduler(model_dir, directory: Path, disk_bytes: int = 1 << 30, **overrides):
    scheduler = start_scheduler(
        model_dir,
        prefix_cache_dir=str(directory),
        prefix_cache_disk_bytes=disk_bytes,
        **overrides,
    )
    assert scheduler._prefix.disk.wait_ready(60)
    return scheduler


async def run(scheduler, ids: list[int], max_tokens: int = 8, scope: str = "key-a"):
    request = GenerationRequest(
        f"r{len(ids)}-{scope}",
        tuple(ids),
        max_tokens,
        SamplingParams(temperature=0.0),
        ignore_eos=True,
        cache_scope=scope,
    )
    events = await scheduler.submit(request).collect()
    return [t for e in events for t in e.token_ids], events[-1].cached_tokens


async def served_once(model_dir, directory: Path, ids: list[int], **overrides) -> int:
    """A server that sees `ids` once and shuts down (its writes finished); the prompt
    tokens it found cached."""
    scheduler = disk_scheduler(model_dir, directory, **overrides)
    try:
        _, cached = await run(scheduler, ids)
    finally:
        scheduler.stop()
    return cached


def files(directory: Path) -> list[Path]:
    """The entries the tier keeps for `--prefix-cache-dir directory` (in its subfolder)."""
    return sorted((directory / SUBFOLDER).glob(f"*{SUFFIX}"))


async def test_a_restart_serves_an_extended_prompt_from_disk(tiny_model_dir, reference, tmp_path):
    directory = tmp_path / "prefix"
    ids = long_prompt(reference.tokenizer)
    assert await served_once(tiny_model_dir, directory, ids) == 0
    assert files(directory), "the finished request's cache was written"
    assert stat.S_IMODE((directory / SUBFOLDER).stat().st_mode) == 0o700
    for path in files(directory):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert "key-a" not in path.name

    extended = ids + reference.tokenizer.encode(MORE, add_special_tokens=False)
    scheduler = disk_scheduler(tiny_model_dir, directory)
    try:
        other, other_cached = await run(scheduler, extended, scope="key-b")
        tokens, cached = await run(scheduler, extended)
        async with make_client(scheduler) as client:
            stats = (await client.get("/v1/stats")).json()["prefix_cache"]
            exposition = (await client.get("/metrics")).text
    finally:
        scheduler.stop()
    expected = reference.greedy_tokens(extended, 8)
    assert other_cached == 0, "another key's entry was served"
    assert cached >= len(ids), "the restart prefilled what was on disk"
    assert tokens == expected and other == expected
    assert stats["hits"] == {"ram": 0, "disk": 1} and stats["disk"]["files"] >= 1
    assert 'tandem_prefix_cache_hits_total{model_name="tiny",tier="disk"} 1.0' in exposition
    # the writer thread may have written this run's entries between the two reads
    pattern = r'^tandem_prefix_cache_disk_bytes\{model_name="tiny"\} (\S+)$'
    gauge = re.search(pattern, exposition, re.M)
    assert stats["disk"]["bytes"] > 0 and gauge and float(gauge.group(1)) > 0


@pytest.mark.parametrize("damage", ["flipped byte", "truncated payload", "truncated header"])
async def test_a_damaged_file_is_dropped_and_logged_not_loaded(
    tiny_model_dir, reference, tmp_path, caplog, damage
):
    directory = tmp_path / "prefix"
    ids = long_prompt(reference.tokenizer)
    await served_once(tiny_model_dir, directory, ids)
    [path] = files(directory)
    data = bytearray(path.read_bytes())
    if damage == "flipped byte":
        data[-100] ^= 0x40
    elif damage == "truncated payload":
        data = data[: len(data) - 1000]
    else:
        data = data[:40]
    path.write_bytes(bytes(data))

    caplog.set_level(logging.WARNING, logger="scheduler.prefix_disk")
    scheduler = disk_scheduler(tiny_model_dir, directory)
    try:
        tokens, cached = await run(scheduler, ids)
        rejected = scheduler._prefix.stats()["disk"]["rejected_files"]
    finally:
        scheduler.stop()
    assert cached == 0 and tokens == reference.greedy_tokens(ids, 8)
    assert rejected == 1
    assert any(path.name in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)
    assert path.read_bytes() != bytes(data), "the damaged file is gone (or rewritten whole)"


async def test_another_models_files_are_never_served(
    tiny_model_dir, perturbed_draft_dir, reference, tmp_path, caplog
):
    """A server for another model over the same directory finds no hit and leaves the
    first model's files alone; a file of that model renamed as this model's is
    dropped and logged at start."""
    directory = tmp_path / "prefix"
    ids = long_prompt(reference.tokenizer)
    await served_once(tiny_model_dir, directory, ids)
    [mine] = files(directory)
    assert await served_once(perturbed_draft_dir, directory, ids) == 0, "served A's entry"
    assert len(files(directory)) == 2
    [mine] = [p for p in files(directory) if p == mine]
    other_ids = long_prompt(reference.tokenizer, "A different story about a cat. ")
    await served_once(perturbed_draft_dir, directory, other_ids)
    [theirs] = [p for p in files(directory) if p.name[16:] != mine.name[16:]]
    assert mine.exists()

    forged = mine.with_name(mine.name[:16] + theirs.name[16:])
    theirs.rename(forged)
    caplog.set_level(logging.WARNING, logger="scheduler.prefix_disk")
    scheduler = disk_scheduler(tiny_model_dir, directory)
    try:
        tokens, cached = await run(scheduler, ids)
    finally:
        scheduler.stop()
    assert not forged.exists()
    assert any(forged.name in r.getMessage() for r in caplog.records)
    assert cached == len(ids) - 1, "this model's own entry still serves"
    assert tokens == reference.greedy_tokens(ids, 8)


def _filled(model, tokens: list[int]) -> list:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(tokens)[None], cache=cache))
    return cache


def _tier(directory: Path, max_bytes: int, draft: str = "") -> DiskTier:
    tier = DiskTier(directory, max_bytes)
    tier.open(lambda: ("a" * 64, draft))
    assert tier.wait_ready(10)
    return tier


def test_the_byte_bound_evicts_the_least_recently_used(reference, tmp_path):
    tokenizer, model = reference.tokenizer, reference.model
    prompts = [long_prompt(tokenizer, f"Story number {i} about a boat. ", 40) for i in range(3)]
    caches = [_filled(model, p) for p in prompts]
    probe = _tier(tmp_path / "probe", 1 << 30)
    probe.save(prompts[0], caches[0], "k", "assistant", len(caches[0]))
    assert probe.flush()
    size = probe.nbytes
    probe.close()

    tier = _tier(tmp_path / "prefix", int(2.5 * size))
    tier.save(prompts[0], caches[0], "k", "assistant", len(caches[0]))
    tier.save(prompts[1], caches[1], "k", "assistant", len(caches[1]))
    assert tier.flush()
    used, served = tier.best(prompts[0] + [5], "k", 0)  # the first is used again
    assert served == len(prompts[0]) and tier.load(used) is not None
    tier.save(prompts[2], caches[2], "k", "assistant", len(caches[2]))
    assert tier.flush()
    assert tier.nbytes <= tier.max_bytes and len(files(tmp_path / "prefix")) == 2
    evicted = tier.best(prompts[1] + [5], "k", 0)  # at most the shared words remain
    assert evicted is None or evicted[1] < 10, "the least recently used went"
    assert tier.best(prompts[0] + [5], "k", 0) is not None
    assert tier.best(prompts[2] + [5], "k", 0) is not None
    tier.close()
    again = _tier(tmp_path / "prefix", int(2.5 * size))  # the index, from the headers
    assert again.best(prompts[2] + [5], "k", 0)[1] == len(prompts[2])
    assert again.best(prompts[2] + [5], "other", 0) is None
    again.close()


@pytest.mark.parametrize("same_draft", [True, False])
def test_the_draft_cache_comes_back_beside_the_targets(
    reference, perturbed_draft_dir, tmp_path, same_draft
):
    """After a restart the entry's draft-model cache is served with the target's, when
    the server's draft model is the one that made it; otherwise the target's alone."""
    draft_model, _ = load(str(perturbed_draft_dir))
    tokens = long_prompt(reference.tokenizer)
    writer = PrefixCache(4, disk=_tier(tmp_path, 1 << 30, draft="d" * 64))
    target = _filled(reference.model, tokens)
    writer.store(tokens, target, "k", DraftState(_filled(draft_model, tokens), list(tokens)))
    writer.close()

    reader = PrefixCache(4, disk=_tier(tmp_path, 1 << 30, draft="d" * 64 if same_draft else ""))
    query = tokens + reference.tokenizer.encode(MORE, add_special_tokens=False)
    hit = reader.lookup(query, "k")
    assert hit.tier == "disk" and hit.cached == len(tokens)
    following = mx.array(query[len(tokens) : len(tokens) + 3])[None]
    fresh = _filled(reference.model, tokens)
    expected = reference.model(following, cache=fresh)
    assert mx.allclose(reference.model(following, cache=hit.cache), expected, atol=1e-4)
    if not same_draft:
        assert hit.draft is None
        return
    assert hit.draft.fed == tokens
    fresh = _filled(draft_model, tokens)
    expected = draft_model(following, cache=fresh)
    assert mx.allclose(draft_model(following, cache=hit.draft.cache), expected, atol=1e-4)


async def test_a_restart_with_a_draft_model_stays_exact(
    tiny_model_dir, perturbed_draft_dir, reference, tmp_path
):
    directory = tmp_path / "prefix"
    ids = long_prompt(reference.tokenizer)
    draft = {"draft_model": str(perturbed_draft_dir)}
    await served_once(tiny_model_dir, directory, ids, **draft)
    extended = ids + reference.tokenizer.encode(MORE, add_special_tokens=False)
    scheduler = disk_scheduler(tiny_model_dir, directory, **draft)
    try:
        tokens, cached = await run(scheduler, extended, max_tokens=24)
        hits = scheduler._prefix.stats()["hits"]
    finally:
        scheduler.stop()
    assert cached >= len(ids) - 16 and hits["disk"] == 1
    assert tokens == reference.greedy_tokens(extended, 24)


@pytest.mark.parametrize("kind", ["sliding", "lfm2", "qwen3_next"])
async def test_window_and_recurrent_caches_come_back_after_a_restart(
    tiny_model_dir, tmp_path, kind
):
    """A conversation's next turn extends the finished request's cache (a slid window,
    recurrent state: neither can be cut back); a repeated prompt of a recurrent model
    starts from its prompt checkpoint. Both come back from disk exactly."""
    path = build_tiny_arch(kind, tmp_path / kind, tiny_model_dir)
    reference = Reference(*load(str(path)))
    directory = tmp_path / "prefix"
    ids = long_prompt(reference.tokenizer)
    scheduler = disk_scheduler(path, directory)
    try:
        reply, _ = await run(scheduler, ids)
    finally:
        scheduler.stop()
    turn = ids + reply + reference.tokenizer.encode(MORE, add_special_tokens=False)
    scheduler = disk_scheduler(path, directory)
    try:
        tokens, cached = await run(scheduler, turn)
        again, cached_again = await run(scheduler, ids, scope="key-a")
    finally:
        scheduler.stop()
    assert cached >= len(ids), "the finished request's cache came back from disk"
    assert tokens == reference.greedy_tokens(turn, 8)
    assert again == reply
    if kind != "sliding":  # recurrent: the prompt's checkpoint
        assert cached_again == len(ids) - 1


def test_no_tier_without_a_bound(tiny_model_dir):
    scheduler = start_scheduler(tiny_model_dir, prefix_cache_disk_bytes=0)
    try:
        assert scheduler._prefix.disk is None
    finally:
        scheduler.stop()
    assert os.environ.get("TANDEM_PREFIX_CACHE_DISK_GB") == "0", "tests keep ~/.cache clean"


def test_the_weights_hash_memo_is_private_and_follows_changes(tmp_path):
    """The memo of weight hashes (named by the user's file paths) is a 0700 folder; a
    changed file is hashed afresh, an unchanged one is read from the memo."""
    import hashlib

    from engines.model.cache_paths import remembered_sha256

    weights, memo = tmp_path / "weights.bin", tmp_path / "prefix" / ".hashes"
    weights.write_bytes(b"first")
    assert remembered_sha256(weights, memo) == hashlib.sha256(b"first").hexdigest()
    assert stat.S_IMODE(memo.stat().st_mode) == 0o700
    (remembered,) = list(memo.iterdir())
    remembered.write_text("f" * 64)  # what the memo says is what an unchanged file gets
    assert remembered_sha256(weights, memo) == "f" * 64
    weights.write_bytes(b"second, longer")
    assert remembered_sha256(weights, memo) == hashlib.sha256(b"second, longer").hexdigest()
