"""`tandem bench soak matrix`: random server settings x cache kinds with cancels, unread
streams (pauses) and migrations, in-process. A bounded run here: no FAILED state, no
exception logged, no request failed or left behind, greedy outputs equal to serving
each alone, MLX memory flat between rounds."""

from __future__ import annotations

import pytest

from bench.soak_matrix import parse_models, run_matrix
from tests.tiny_archs import build_tiny_arch


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model_dir, perturbed_draft_dir) -> dict:
    root = tmp_path_factory.mktemp("matrix")
    sliding = build_tiny_arch("sliding", root / "sliding", tiny_model_dir)
    sliding_draft = build_tiny_arch("sliding", root / "sliding-d", tiny_model_dir, noise=0.05)
    return {
        "plain": (str(tiny_model_dir), str(perturbed_draft_dir)),
        "sliding": (str(sliding), str(sliding_draft)),
        "hybrid": (str(build_tiny_arch("lfm2", root / "lfm2", tiny_model_dir)), None),
        "hybrid-draft": (
            str(build_tiny_arch("qwen3_next", root / "qnext", tiny_model_dir)),
            str(perturbed_draft_dir),
        ),
        "mtp": (str(build_tiny_arch("qwen3_5", root / "mtp", tiny_model_dir, mtp="copy")), None),
    }


def assert_clean(report: dict) -> None:
    failures = [r for r in report["rounds"] if not r["passed"]]
    assert not failures, failures
    assert report["failed_states"] == 0 and report["exceptions"] == 0
    assert report["memory_flat"], report["memory_between_rounds"]
    assert report["passed"]


async def test_one_round_of_the_matrix_soak_is_clean(models):
    report = await run_matrix({"plain": models["plain"]}, rounds=1, seed=3, requests=8)
    assert_clean(report)
    (only,) = report["rounds"]
    assert only["requests"] == 8 and only["completed"] + only["cancelled"] == 8


@pytest.mark.slow
async def test_a_bounded_matrix_soak_over_every_cache_kind_is_clean(models):
    report = await run_matrix(models, rounds=10, seed=43, requests=10)
    assert_clean(report)
    assert {r["config"]["kind"] for r in report["rounds"]} >= {"plain", "sliding", "mtp"}


def test_models_are_named_kind_target_and_draft():
    assert parse_models(["plain=/a:/b", "mtp=/c"]) == {"plain": ("/a", "/b"), "mtp": ("/c", None)}
    with pytest.raises(SystemExit):
        parse_models(["/just/a/path"])
