"""Real lm-eval against a real `tandem serve`, given nothing but the completions URL and
the served name: it builds its tokenizer from /tokenizer_info and /tokenize (offline, no
hub download), and the loglikelihoods it reports for a local task equal plain mlx-lm's
on the same model and token split.

The slow tier's Makefile target installs lm-eval (`lm-eval[api]`, no torch); where it is
missing this test fails saying so, it is never skipped."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load

from tests.conftest import SHARED_MODELS
from tests.test_process import BLAS_PRELOAD, env_without, running_server

pytestmark = pytest.mark.slow

LM_EVAL = Path(sys.executable).parent / "lm_eval"
MODEL = SHARED_MODELS / "stories260K"
SERVED = "stories260K"  # no hub id this machine could download
# Story openings whose continuation a TinyStories model can rank; the last two golds are
# answers it ranks low, so the accuracy is neither 0 nor 1.
CHOICE_DOCS = [
    {"context": "Once upon a time, there was a little", "choices": ["girl", "table"], "label": 0},
    {"context": "Lily wanted to play with her", "choices": ["ball", "car engine"], "label": 0},
    {"context": "The sun was shining. The birds were", "choices": ["singing", "cold"], "label": 0},
    {"context": "Tom was sad because he lost his", "choices": ["toy", "way home"], "label": 0},
    {"context": "One day, a big dog ran to the", "choices": ["park", "moon"], "label": 1},
    {"context": "She said thank you to her", "choices": ["mom", "shoe", "homework"], "label": 2},
]
GREEDY_DOCS = [
    {"context": "Once upon a time, there was a", "continuation": " little"},
    {"context": "Once upon a time", "continuation": ","},
    {"context": "They played together all day. The", "continuation": " end"},
    {"context": "Lily and Ben were", "continuation": " purple elephants"},
]
TASKS = {
    "tandem_choice": """
task: tandem_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/choice.jsonl
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
    "tandem_greedy": """
task: tandem_greedy
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/greedy.jsonl
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
}


def write_tasks(folder: Path) -> Path:
    """The two tasks' YAML and their local data: nothing for lm-eval to download."""
    folder.mkdir()
    for name, docs in (("choice", CHOICE_DOCS), ("greedy", GREEDY_DOCS)):
        lines = [json.dumps(doc) for doc in docs]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    for task, text in TASKS.items():
        (folder / f"{task}.yaml").write_text(text.format(data=folder))
    return folder


def reference_scores(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """What lm-eval computes, with plain mlx-lm: the continuation's log-probability after
    the context (split as lm-eval splits it: the whole encoded, the context's ids cut
    off), and whether every continuation token is the greedy one."""
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    continuation_ids = whole[len(context_ids) :]
    logits = model(mx.array([context_ids + continuation_ids]))[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    rows = logprobs[len(context_ids) - 1 : -1]
    picked = [rows[i, token].item() for i, token in enumerate(continuation_ids)]
    greedy = all(mx.argmax(rows, axis=-1).tolist()[i] == t for i, t in enumerate(continuation_ids))
    return math.fsum(picked), greedy


def read_samples(output: Path, task: str) -> list[dict]:
    files = sorted(output.rglob(f"samples_{task}_*.jsonl"))
    assert files, f"lm-eval wrote no samples for {task} under {output}"
    return [json.loads(line) for line in files[-1].read_text().splitlines()]


def scores(sample: dict) -> list[tuple[float, bool]]:
    """A logged sample's (loglikelihood, is_greedy) per request; lm-eval logs them as text."""
    return [(float(ll), greedy == "True") for ll, greedy in sample["filtered_resps"]]


def continuations(sample: dict) -> list[str]:
    return [args["arg_1"] for args in sample["arguments"].values()]


def read_results(output: Path) -> dict:
    files = sorted(output.rglob("results_*.json"))
    assert files, f"lm-eval wrote no results under {output}"
    return json.loads(files[-1].read_text())["results"]


@pytest.fixture(scope="module")
def server():
    assert MODEL.is_dir(), f"{MODEL} is missing: ../shared/models holds the test models"
    args = [str(MODEL), "--served-model-name", SERVED]
    with running_server(args, env_without(*BLAS_PRELOAD, "TANDEM_API_KEY")) as proc:
        yield proc


@pytest.fixture(scope="module")
def lm_eval() -> Path:
    """The real client, or a failure saying how to get it (never a skip)."""
    if not LM_EVAL.exists():
        pytest.fail(
            f"lm-eval is not installed in {LM_EVAL.parent}: `make test-slow` installs it "
            "(pip install 'lm-eval[api]==0.4.13'); this test checks Tandem with the real client"
        )
    return LM_EVAL


@pytest.fixture(scope="module")
def evaluated(lm_eval, server, tmp_path_factory) -> Path:
    """One lm-eval run of both tasks with only base_url and model: its output folder."""
    work = tmp_path_factory.mktemp("lm_eval")
    tasks, output = write_tasks(work / "tasks"), work / "out"
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env = env_without("OPENAI_API_KEY", HF_HOME=str(work / "hf"), **offline)
    command = [
        str(lm_eval),
        "--model",
        "local-completions",
        "--model_args",
        f"base_url={server.url}/v1/completions,model={SERVED}",
        "--tasks",
        ",".join(TASKS),
        "--include_path",
        str(tasks),
        "--log_samples",
        "--output_path",
        str(output),
    ]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"lm-eval failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    assert "/tokenizer_info" in server.log(), "lm-eval did not ask for the tokenizer"
    return output


@pytest.fixture(scope="module")
def reference():
    return load(str(MODEL))


def test_choice_loglikelihoods_equal_mlx_lm_and_so_does_accuracy(evaluated, reference):
    samples = sorted(read_samples(evaluated, "tandem_choice"), key=lambda s: s["doc_id"])
    assert [s["doc"] for s in samples] == CHOICE_DOCS
    correct = 0
    for sample, doc in zip(samples, CHOICE_DOCS, strict=True):
        expected = [reference_scores(*reference, doc["context"], f" {c}") for c in doc["choices"]]
        assert continuations(sample) == [f" {c}" for c in doc["choices"]]
        for (served_ll, _), (expected_ll, _) in zip(scores(sample), expected, strict=True):
            assert served_ll == pytest.approx(expected_ll, rel=1e-4, abs=1e-4), doc
        lls = [ll for ll, _ in expected]
        right = lls.index(max(lls)) == doc["label"]
        assert sample["acc"] == float(right), doc
        correct += right
    assert 0 < correct < len(CHOICE_DOCS)
    accuracy = read_results(evaluated)["tandem_choice"]["acc,none"]
    assert accuracy == pytest.approx(correct / len(CHOICE_DOCS))


def test_greedy_flags_and_loglikelihoods_equal_mlx_lm(evaluated, reference):
    samples = sorted(read_samples(evaluated, "tandem_greedy"), key=lambda s: s["doc_id"])
    greedy_count = 0
    for sample, doc in zip(samples, GREEDY_DOCS, strict=True):
        assert continuations(sample) == [doc["continuation"]]
        [(served_ll, served_greedy)] = scores(sample)
        expected_ll, expected_greedy = reference_scores(
            *reference, doc["context"], doc["continuation"]
        )
        assert served_ll == pytest.approx(expected_ll, rel=1e-4, abs=1e-4), doc
        assert served_greedy == expected_greedy, doc
        greedy_count += expected_greedy
    assert 0 < greedy_count < len(GREEDY_DOCS)  # both outcomes are exercised
    accuracy = read_results(evaluated)["tandem_greedy"]["acc,none"]
    assert accuracy == pytest.approx(greedy_count / len(GREEDY_DOCS))
