"""What the prefix cache's disk tier owns (scheduler/prefix_folder.py): given any folder
(a model's, a shared one), it works in a subfolder of its own and touches nothing else,
never changes the given folder's mode, refuses a folder of its own that others could
write into, removes only temps a crashed writer of its own left, and shares its folder
with another server without deleting that server's writes. The salt of API-key ids it
keeps there is the same for the same keys and made anew when they change."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from safetensors.numpy import save_file

from bench.single_stream import free_port
from scheduler.prefix_disk import DiskTier
from scheduler.prefix_files import file_name
from scheduler.prefix_folder import MARKER, SALT, SUBFOLDER, own_folder, scope_salt, temp_name
from server.auth import key_id

TANDEM = str(Path(sys.executable).parent / "tandem")
MODEL_A, MODEL_B = "a" * 64, "b" * 64
MIN_TOKENS = 8  # entries of a few dozen tokens: quick to fill, write and read


def _tier(directory: Path, max_bytes: int, identity: str = MODEL_A) -> DiskTier:
    tier = DiskTier(directory, max_bytes, min_tokens=MIN_TOKENS)
    tier.open(lambda: (identity, ""))
    assert tier.wait_ready(10)
    return tier


def _entry(reference, number: int) -> tuple[list[int], list]:
    tokens = reference.tokenizer.encode(f"Story number {number} about a boat on the sea. " * 3)
    cache = make_prompt_cache(reference.model)
    mx.eval(reference.model(mx.array(tokens)[None], cache=cache))
    return tokens, cache


def _write(tier: DiskTier, tokens: list[int], cache: list) -> None:
    tier.save(tokens, cache, "k", "assistant", len(cache))
    assert tier.flush()


def _serves(tier: DiskTier, tokens: list[int]) -> bool:
    found = tier.best(tokens + [5], "k", 0)
    return found is not None and found[1] == len(tokens)


def _not_the_tiers(folder: Path) -> None:
    """Files a user (or another program) keeps in `folder`, oldest first in any LRU."""
    save_file({"w": np.arange(65536, dtype=np.float32)}, str(folder / "model.safetensors"))
    (folder / "notes.tmp").write_text("my notes")
    (folder / "something.safetensors.123.tmp").write_bytes(b"half a download")
    (folder / "sub").mkdir(exist_ok=True)
    (folder / "sub" / "inside.safetensors").write_bytes(b"not a tier entry")
    # named as the tier names entries, but not one (no header of the tier's)
    lookalike = folder / f"{'0123456789abcdef'}-{'0' * 16}-{'0' * 24}.safetensors"
    save_file({"w": np.ones(65536, dtype=np.float32)}, str(lookalike))
    for path in folder.rglob("*"):
        os.utime(path, (946684800, 946684800))  # the year 2000


def _contents(*folders: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for f in folders for p in f.rglob("*") if p.is_file()}


def test_files_the_tier_did_not_write_are_never_touched(reference, tmp_path):
    """In the given folder and in the tier's own: not deleted, not evicted, not
    counted against the bound; the given folder's mode is left as it was."""
    entries = [_entry(reference, i) for i in range(3)]
    probe = _tier(tmp_path / "probe", 1 << 30)
    _write(probe, *entries[0])
    size = probe.nbytes
    probe.close()

    given = tmp_path / "models"
    given.mkdir()
    os.chmod(given, 0o775)
    first = _tier(given, 1 << 30)  # makes its folder
    first.close()
    _not_the_tiers(given)
    _not_the_tiers(first.directory)
    kept = _contents(given)
    kept_bytes = sum(len(data) for data in kept.values())
    assert kept_bytes > 2 * size, "counted, they would be evicted"

    tier = _tier(given, int(1.5 * size))
    for tokens, cache in entries:
        _write(tier, tokens, cache)
    assert tier.nbytes <= tier.max_bytes and tier.stats()["files"] == 1
    assert _serves(tier, entries[2][0]) and not _serves(tier, entries[0][0])
    tier.close()
    _tier(given, int(1.5 * size)).close()  # a restart scans the folder again

    now = _contents(given)
    assert {p: now.get(p) for p in kept} == kept, "a file the tier did not write changed"
    assert stat.S_IMODE(given.stat().st_mode) == 0o775
    assert tier.directory == given / SUBFOLDER and (tier.directory / MARKER).is_file()
    assert stat.S_IMODE(tier.directory.stat().st_mode) == 0o700


def test_another_models_entries_count_toward_the_bound_and_go_first(reference, tmp_path):
    """Entries another model's tier wrote (its name, its header) are the tier's own:
    they take room, and the least recently used goes, whoever's it is."""
    (old, old_cache), (new, new_cache) = _entry(reference, 0), _entry(reference, 1)
    theirs = _tier(tmp_path, 1 << 30, MODEL_B)
    _write(theirs, old, old_cache)
    size = theirs.nbytes
    theirs.close()
    mine = _tier(tmp_path, int(1.5 * size))
    assert mine.nbytes == size and not _serves(mine, old)
    _write(mine, new, new_cache)
    assert mine.nbytes <= mine.max_bytes and _serves(mine, new)
    mine.close()
    assert not _serves(_tier(tmp_path, 1 << 30, MODEL_B), old), "theirs was evicted"


def test_only_a_crashed_writers_temps_are_removed(tmp_path):
    """At start the tier removes temps in its pattern whose writer, on this host, is
    gone; a live writer's temp (another server's, or a tier beside it in this
    process), another host's and any other `.tmp` stay."""
    folder = own_folder(tmp_path)
    entry = file_name(MODEL_A, MODEL_B, [1, 2, 3])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    writing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        crashed = [folder / temp_name(entry, gone.pid), folder / temp_name(SALT, gone.pid)]
        name = temp_name(entry, gone.pid).split(".")
        name[2] = f"{int(name[2], 16) ^ 1:08x}"  # the same, written on another host
        kept = [
            folder / temp_name(entry, writing.pid),
            folder / temp_name(entry),
            folder / ".".join(name),
            folder / f"{entry}.{gone.pid}.tmp",
            folder / "notes.tmp",
        ]
        for path in crashed + kept:
            path.write_bytes(b"partial")
        _tier(tmp_path, 1 << 30).close()
    finally:
        writing.kill()
        writing.wait()
    assert [p.name for p in crashed if p.exists()] == []
    assert [p.name for p in kept if not p.exists()] == []


def _unsafe_folder(given: Path, how: str, monkeypatch) -> Path:
    folder = given / SUBFOLDER
    if how == "a link":
        (given / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(given / "elsewhere")
        return folder
    if how == "not marked":
        folder.mkdir(mode=0o700)
        (folder / "someone's.safetensors").write_bytes(b"x")
        return folder
    own_folder(given)
    if how == "another user's":
        uid = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    else:
        os.chmod(folder, 0o770 if how == "group-writable" else 0o707)
    return folder


@pytest.mark.parametrize(
    "how", ["group-writable", "world-writable", "another user's", "a link", "not marked"]
)
def test_a_tier_folder_others_could_write_into_is_refused(tmp_path, monkeypatch, how):
    folder = _unsafe_folder(tmp_path, how, monkeypatch)
    before = stat.S_IMODE(folder.lstat().st_mode), _contents(tmp_path)
    with pytest.raises(SystemExit, match=re.escape(f"prefix cache folder {folder}: ")):
        DiskTier(tmp_path, 1 << 30)
    assert (stat.S_IMODE(folder.lstat().st_mode), _contents(tmp_path)) == before


def test_tandem_serve_refuses_a_shared_tier_folder_at_start(tiny_model_dir, tmp_path):
    folder = own_folder(tmp_path / "cache")
    os.chmod(folder, 0o777)
    done = subprocess.run(
        [TANDEM, "serve", str(tiny_model_dir), "--prefix-cache-dir", str(tmp_path / "cache")]
        + ["--prefix-cache-disk-gb", "1", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert f"refusing the prefix cache folder {folder}: others can write" in done.stderr


@pytest.mark.parametrize("second", [MODEL_A, MODEL_B], ids=["same model", "another model"])
def test_two_tiers_sharing_a_folder_keep_each_others_writes(
    reference, tmp_path, monkeypatch, second
):
    """A second server starts while the first is writing (its temp on disk): the
    first's write still lands, and after a restart both entries serve."""
    (a_tokens, a_cache), (b_tokens, b_cache) = _entry(reference, 0), _entry(reference, 1)
    first, beside, replace = _tier(tmp_path, 1 << 30), [], os.replace

    def second_starts_then_replace(source, target) -> None:
        if not beside:
            beside.append(_tier(tmp_path, 1 << 30, second))
        replace(source, target)

    monkeypatch.setattr(os, "replace", second_starts_then_replace)
    _write(first, a_tokens, a_cache)
    [other] = beside
    _write(other, b_tokens, b_cache)
    monkeypatch.undo()
    first.close()
    other.close()
    assert first.writes == other.writes == 1
    assert _serves(_tier(tmp_path, 1 << 30), a_tokens)
    assert _serves(_tier(tmp_path, 1 << 30, second), b_tokens)


def test_the_scope_salt_is_kept_for_the_same_keys_and_made_anew_for_others(tmp_path):
    folder = own_folder(tmp_path)
    salt = scope_salt(folder, ("key-one", "key-two"))
    assert scope_salt(folder, ("key-two", "key-one", "key-one")) == salt, "the same set"
    assert stat.S_IMODE((folder / SALT).stat().st_mode) == 0o600
    assert b"key-one" not in (folder / SALT).read_bytes()
    fewer = scope_salt(folder, ("key-one",))
    assert fewer != salt and key_id("key-one", fewer) != key_id("key-one", salt)
    assert scope_salt(folder, ("key-one", "key-two")) not in (salt, fewer), "never reused"


def test_servers_starting_together_agree_on_one_salt(tmp_path):
    folder = own_folder(tmp_path)
    with ThreadPoolExecutor(8) as pool:
        salts = set(pool.map(lambda _: scope_salt(folder, ("key-one",)), range(16)))
    assert len(salts) == 1
