"""`tandem draft train --from-traffic`: a real `tandem serve` with two API keys and its
prefix cache on disk serves both keys' users; the drafter is then trained on what one
key's users sent and the model answered -- read from the entries' headers, the other
key's never -- and only with the operator's consent flag."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from mlx_lm import load

from engines.model.registry import load_model
from scheduler.prefix_traffic import traffic_tokens
from tests.test_prefix_disk_keys import KEY_A, KEY_B, STORY, auth, serving
from training.cli import main as train
from training.cli import served_traffic

ASKED = {  # each key's users ask about something of their own (past the tier's 256 tokens)
    KEY_A: "The robot found a shiny blue shell on the beach. " * 30,
    KEY_B: "A green frog sang to the moon every night by the pond. " * 30,
}
SMALL = ["--seq-len", "32", "--batch-size", "2", "--holdout", "2", "--steps", "3"]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """(the server's prefix-cache folder, the key file of key A) after each key's users
    sent their prompt to a real `tandem serve`."""
    root = tmp_path_factory.mktemp("traffic")
    keys, cache, log = root / "keys", root / "cache", root / "serve.log"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    with serving(tiny_model_dir, keys, cache, log) as url:
        for key, prompt in ASKED.items():
            body = {"model": "tiny", "prompt": STORY + prompt, "max_tokens": 8, "temperature": 0}
            response = httpx.post(f"{url}/v1/completions", json=body, headers=auth(key), timeout=60)
            assert response.status_code == 200, response.text
    mine = root / "operator-keys"
    mine.write_text(f"# the operator's key\n{KEY_A}\n")
    return cache, mine


def test_only_the_operators_keys_traffic_is_read(served, tiny_model_dir, tmp_path):
    cache, mine = served
    tokenizer = load(str(tiny_model_dir))[1]
    out = tmp_path / "drafter"
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "draft", "train", str(tiny_model_dir), "--out",
         str(out), "--from-traffic", str(cache), "--traffic-key-file", str(mine),
         "--traffic-consent", *SMALL],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "traffic 1 conversations" in done.stderr, done.stderr
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    # what it read: key A's prompt and the model's answer, never key B's
    (record,) = served_traffic(cache, load_model(str(tiny_model_dir)), (KEY_A,))
    text = tokenizer.decode(list(record.tokens))
    assert "shiny blue shell" in text and "green frog" not in text
    assert len(record.tokens) > len(tokenizer.encode(STORY + ASKED[KEY_A])), "with its answer"


def test_no_consent_no_traffic_and_no_key_no_entries(served, tiny_model_dir, tmp_path):
    cache, mine = served
    args = [str(tiny_model_dir), "--out", str(tmp_path / "d"), "--from-traffic", str(cache)]
    with pytest.raises(SystemExit) as refused:
        train([*args, "--traffic-key-file", str(mine), *SMALL])
    assert refused.value.code == 2  # argparse: the message names --traffic-consent
    with pytest.raises(SystemExit, match="no entries of a keyless server"):
        train([*args, "--traffic-consent", *SMALL])  # no key: a keyed server's are not read
    assert traffic_tokens(cache, "0" * 64, (KEY_A,)) == [], "another model's identity"
