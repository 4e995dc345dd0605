"""`tandem draft train` on the real TinyStories model (stories260K): the target answers
story prompts itself, an EAGLE-3 drafter is trained on its answers in well under a
minute, and then, through the real engine, it is accepted far more often than a
random drafter of the same shape while output stays token-identical to plain
decoding. A run killed (SIGKILL) mid-way and started again with the same command ends
with the same weights as one never interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load

from bench.draft_eval import main as draft_eval
from bench.drafter_checkpoints import write_eagle3
from engines.drafting.feature_drafters import load_feature_drafter
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from engines.sequence import make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from tests.conftest import Reference
from training.cli import main as train
from training.corpus import Chunks, Record
from training.stdlib_prompts import stdlib_prompts

ROOT = Path(__file__).resolve().parent.parent
STORIES = ROOT.parent / "shared" / "models" / "stories260K"
DATA = ROOT / "bench" / "data"
TRAIN = ["--seq-len", "64", "--batch-size", "8", "--learning-rate", "3e-3", "--warmup", "10"]
HELD_OUT = [  # stories the drafter never saw begun
    "The little bird could not find its nest.",
    "Tom and his dog went to the park to play.",
    "A big red ball rolled down the hill.",
]


def prompts_file(folder: Path) -> Path:
    """The bench's story prompts, three times each (three sampled answers each)."""
    prompts = [
        json.loads(line)["prompt"]
        for name in ("novel", "echo", "mixed")
        for line in (DATA / f"{name}.jsonl").read_text().splitlines()
        if line.strip()
    ]
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts * 3))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, float]:
    """(the drafter's folder, seconds the whole command took)."""
    folder = tmp_path_factory.mktemp("train")
    out = folder / "drafter"
    args = [str(STORIES), "--out", str(out), "--data", str(prompts_file(folder))]
    started = time.monotonic()
    train([*args, *TRAIN, "--steps", "150", "--answer-tokens", "128",
           "--answer-temperature", "1.0", "--eval-every", "50"])  # fmt: skip
    return out, time.monotonic() - started


def served_acceptance(drafter: Path) -> tuple[float, bool]:
    """(accepted / drafted tokens over the held-out prompts, every output equal to
    mlx-lm's plain greedy decoding) through the real single-stream engine."""
    registry = ModelRegistry.load(str(STORIES))
    registry.feature_drafter = load_feature_drafter(str(drafter), "eagle3", registry.target)
    engine = SpeculativeEngine(registry, SpecConfig())
    registry.transfer(engine.name)
    reference = Reference(*load(str(STORIES)))
    drafted = accepted = 0
    exact = True
    for number, text in enumerate(HELD_OUT):
        prompt = reference.tokenizer.encode(text)
        request = GenerationRequest(
            f"h{number}", tuple(prompt), 96, SamplingParams(temperature=0.0), ignore_eos=True,
            speculation=SpeculationOverrides(enable_pld=False),
        )  # fmt: skip
        seq = make_sequence(request, registry.tokenizer)
        engine.admit(seq)
        while engine.active is not None:
            engine.step()
        exact &= seq.generated == reference.greedy_tokens(prompt, 96)
        stats = seq.spec.by_method.get("eagle3")
        if stats is not None:
            drafted, accepted = drafted + stats.draft_tokens, accepted + stats.accepted_tokens
    return accepted / max(drafted, 1), exact


def test_a_trained_drafter_is_accepted_far_more_than_a_random_one(trained, tmp_path):
    drafter, seconds = trained
    assert seconds < 60, f"training took {seconds:.0f} s"
    config = json.loads((drafter / "config.json").read_text())
    random = write_eagle3(
        tmp_path / "random",
        STORIES,
        aux_ids=config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        draft_vocab=0,
    )
    trained_rate, trained_exact = served_acceptance(drafter)
    random_rate, random_exact = served_acceptance(random)
    assert trained_exact and random_exact, "a drafter changed the output"
    assert trained_rate >= 0.3 and trained_rate >= 4 * random_rate, (trained_rate, random_rate)


def test_draft_eval_reports_the_drafter_beside_plain_and_lookup(trained, capsys):
    drafter, _ = trained
    table = draft_eval([str(STORIES), "--draft-model", str(drafter), "--sets", "novel",
                        "--max-tokens", "64", "--limit", "3"])  # fmt: skip
    rows = table["novel"]
    assert {"mlx-lm", "plain", "pld", "draft"} <= set(rows)
    assert all(row["mismatches"] == 0 for row in rows.values())
    assert rows["draft"]["acceptance_per_position"][0] >= 0.3
    assert "accepted per position" in capsys.readouterr().out


def progress_step(out: Path) -> int:
    path = out / "training_state" / "progress.json"
    try:
        return json.loads(path.read_text())["step"]
    except (OSError, ValueError):
        return 0


def test_a_killed_run_resumes_to_the_uninterrupted_result(trained, tmp_path):
    """Both runs train on the first run's answers (as documents: no generation), 40
    steps with a checkpoint every 10; one is SIGKILLed after its step-20 checkpoint."""
    drafter, _ = trained
    answers = [json.loads(line) for line in (drafter / "answers.jsonl").read_text().splitlines()]
    data = tmp_path / "stories.jsonl"
    data.write_text(
        "".join(json.dumps({"text": a["prompt"] + a["answer"]}) + "\n" for a in answers)
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def command(out: Path) -> list[str]:
        return [sys.executable, "-m", "tandem.cli", "draft", "train", str(STORIES), "--out",
                str(out), "--data", str(data), *TRAIN, "--steps", "40",
                "--checkpoint-steps", "10", "--eval-every", "20"]  # fmt: skip

    whole = tmp_path / "whole"
    subprocess.run(command(whole), env=env, check=True, capture_output=True, timeout=120)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(killed), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while progress_step(killed) < 20 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    interrupted_at = progress_step(killed)
    assert 20 <= interrupted_at < 40
    resumed = subprocess.run(command(killed), env=env, check=True, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert f"step {interrupted_at} (resumed)" in resumed.stderr
    first = mx.load(str(whole / "model.safetensors"))
    second = mx.load(str(killed / "model.safetensors"))
    assert first.keys() == second.keys()
    for key in first:
        assert mx.array_equal(first[key], second[key]), key


def test_a_resume_with_other_settings_is_refused_naming_them(trained, tmp_path):
    drafter, _ = trained
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(drafter), str(copy)], check=True)
    data = json.loads((drafter / "training_state" / "progress.json").read_text())["settings"]
    with pytest.raises(SystemExit, match="seq_len") as refused:
        train([str(STORIES), "--out", str(copy), "--data", data["data"], *TRAIN, "--steps",
               "150", "--seq-len", "32"])  # fmt: skip
    assert "model" not in str(refused.value).split("(")[1]


def test_requests_made_from_the_standard_library(tiny_model_dir):
    """`--prompts N`: N requests from the standard library's documented functions, code
    to write and functions to explain in turn, the same for the same seed, rendered with
    the model's chat template (plain text for a model without one)."""
    chat = load(str(tiny_model_dir))[1]
    plain = load(str(STORIES))[1]
    first = stdlib_prompts(6, 0, plain)
    assert len(first) == 6 and all(r.is_prompt and r.answer is None for r in first)
    assert [r.text.startswith("Write a Python function `") for r in first] == [True, False] * 3
    assert all("standard library" in r.text for r in first[1::2])
    assert [r.text for r in stdlib_prompts(6, 0, plain)] == [r.text for r in first]
    assert [r.text for r in stdlib_prompts(6, 1, plain)] != [r.text for r in first]
    rendered = stdlib_prompts(2, 0, chat)
    messages = [{"role": "user", "content": first[0].text.strip()}]
    assert rendered[0].text == chat.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_answers_are_half_the_training_chunks_beside_documents():
    """A few answers beside a large corpus are drawn for half the training chunks (each
    kind held out too), in the same order for the same seed."""
    tokenizer = load(str(STORIES))[1]
    documents = [Record("Once upon a time there was a little cat. " * 40) for _ in range(30)]
    answers = [Record("Q?", "The big red ball went up and up. " * 20, is_prompt=True)] * 3
    chunks = Chunks(documents + answers, tokenizer, 32, 4)
    marker = tokenizer.encode("ball", add_special_tokens=False)[-1]

    def from_answers(seed: int, n: int) -> list[bool]:
        stream = chunks.training(seed)
        return [bool((next(stream) == marker).any()) for _ in range(n)]

    drawn = from_answers(0, 400)
    assert 0.4 < sum(drawn) / len(drawn) < 0.6, sum(drawn)
    assert from_answers(0, 400) == drawn and from_answers(1, 400) != drawn
    held = [bool((chunk == marker).any()) for chunk in chunks.held_out]
    assert True in held and False in held
