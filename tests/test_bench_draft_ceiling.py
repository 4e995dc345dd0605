"""`tandem bench draft-ceiling`: its teacher-forced draft runs and its replay, on tiny
models. A draft identical to the target is accepted everywhere, so every policy's
replay is checked against what that must give; an unrelated draft is checked against
the oracle bound."""

from __future__ import annotations

import json

from mlx_lm import load

from bench import draft_ceiling
from bench.ceiling import greedy_output
from engines.gating.measured_costs import CostModel


def test_a_draft_equal_to_the_target_is_accepted_at_every_position(tiny_model_dir):
    model, tokenizer = load(str(tiny_model_dir))
    prompt = tokenizer.encode("Once upon a time")
    output = greedy_output(model, prompt, 20, set())
    runs = draft_ceiling.draft_runs(model, prompt, output, 4)
    assert [p.accepted for p in runs] == [min(4, len(output) - i) for i in range(len(output))]
    assert all(len(p.confidences) == 4 and 0 < min(p.confidences) <= 1 for p in runs)
    cost = CostModel((1.0, 1.1, 1.2, 1.3, 1.4), draft_step=0.05)
    fixed = draft_ceiling.replay([runs], cost, draft_ceiling.fixed(4))
    # 20 tokens in four steps, each 4 drafts (0.05 each) and a 5-token verify (1.4)
    assert abs(fixed - 20 / (4 * (4 * 0.05 + 1.4))) < 1e-9
    assert draft_ceiling.replay([runs], cost, draft_ceiling.oracle) >= fixed


def run_ceiling(target, draft, tmp_path, rows: list[dict], *extra: str) -> dict:
    """`tandem bench draft-ceiling` on `rows`, 16 tokens each, one cost round."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(row) for row in rows))
    arguments = [str(target), "--draft-model", str(draft), "--sets", str(prompts)]
    return draft_ceiling.main([*arguments, "--max-tokens", "16", "--rounds", "1", *extra])


def test_the_report_ranks_policies_against_the_best_fixed_k(
    tiny_model_dir, tiny_draft_dir, tmp_path
):
    rows = [{"prompt": "Once upon a time"}, {"prompt": "The dog ran to the park"}]
    output = tmp_path / "out.json"
    results = run_ceiling(tiny_model_dir, tiny_draft_dir, tmp_path, rows, "--output", str(output))
    over_best = results["over_best_fixed"]
    assert max(v for k, v in over_best.items() if k.startswith("fixed")) == 1.0
    assert all(over_best["oracle"] >= v for v in over_best.values())
    assert json.loads(output.read_text())["prompts"] == 2


def test_a_reduced_draft_vocabulary_is_replayed_beside_the_whole_draft(
    tiny_model_dir, perturbed_draft_dir, tmp_path
):
    rows = [{"prompt": "Once upon a time"}]
    results = run_ceiling(
        tiny_model_dir, perturbed_draft_dir, tmp_path, rows, "--draft-vocab", "128"
    )
    measured = results["draft_vocab"][128]
    assert 0 < measured["draft_cost_vs_whole"] and 0 <= measured["first_token_acceptance"] <= 1
    over_best = results["over_best_fixed"]
    reduced = {k: v for k, v in over_best.items() if k.startswith("vocab 128: ")}
    assert len(reduced) == len(over_best) / 2
    assert all(reduced["vocab 128: oracle"] >= v for v in reduced.values())
