"""With API keys, a real `tandem serve` (on 127.0.0.1) restarted over the same
`--prefix-cache-dir` serves a key's prompt from disk: the key's scope is the same after
a restart (its id's salt is kept with the entries), another key's scope still never
serves it, and once the set of keys changes no entry of the earlier keys is served."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.single_stream import free_port
from scheduler.prefix_files import SUFFIX
from scheduler.prefix_folder import SUBFOLDER

TANDEM = str(Path(sys.executable).parent / "tandem")
KEY_A, KEY_B, KEY_C = "key-of-alice-0123456789", "key-of-bob-0123456789", "key-of-carol-012345"
STORY = "Once upon a time there was a little robot who liked to read about the sea. "
PROMPT = STORY * 24  # past the tier's 256 tokens


@contextmanager
def serving(model_dir: Path, keys: Path, cache: Path, log: Path) -> Iterator[str]:
    """`tandem serve` with the keys in `keys` and its prefix cache in `cache`, once its
    disk tier is ready; stopped (its writes finished) when the block ends."""
    port = free_port()
    args = [str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    args += ["--api-key-file", str(keys), "--served-model-name", "tiny"]
    args += ["--prefix-cache-dir", str(cache), "--prefix-cache-disk-gb", "1"]
    with log.open("a") as out:
        process = subprocess.Popen([TANDEM, "serve", *args], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_disk_ready(url, keys_in(keys)[0], process, log)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_disk_ready(
    url: str, key: str, process: subprocess.Popen, log: Path, timeout: float = 90
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"server exited:\n{log.read_text()}"
        try:
            stats = httpx.get(f"{url}/v1/stats", headers=auth(key), timeout=2)
            if stats.status_code == 200 and stats.json()["prefix_cache"]["disk"]["ready"]:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"disk tier not ready in {timeout}s:\n{log.read_text()}")


def keys_in(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line and line[0] != "#"]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def cached_tokens(url: str, key: str) -> int:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=auth(key), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_keys_entries_on_disk_serve_it_after_a_restart_until_the_keys_change(
    tiny_model_dir, tmp_path
):
    keys, cache, log = tmp_path / "keys", tmp_path / "cache", tmp_path / "serve.log"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    with serving(tiny_model_dir, keys, cache, log) as url:
        assert cached_tokens(url, KEY_A) == 0
    assert list((cache / SUBFOLDER).glob(f"*{SUFFIX}")), "the entry was written"

    keys.write_text(f"# the same keys, another order\n{KEY_B}\n{KEY_A}\n")
    with serving(tiny_model_dir, keys, cache, log) as url:
        assert cached_tokens(url, KEY_B) == 0, "another key's entry was served"
        assert cached_tokens(url, KEY_A) > 0, "the restart did not serve the key's entry"
        stats = httpx.get(f"{url}/v1/stats", headers=auth(KEY_A)).json()["prefix_cache"]
        assert stats["hits"]["disk"] == 1

    keys.write_text(f"{KEY_A}\n{KEY_C}\n")
    with serving(tiny_model_dir, keys, cache, log) as url:
        assert cached_tokens(url, KEY_A) == 0, "an entry of the earlier keys was served"
        assert cached_tokens(url, KEY_C) == 0
