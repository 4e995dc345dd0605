"""`tandem bench spec`'s paired summary: each prompt against plain on the same prompt."""

from __future__ import annotations

import math

import pytest

from bench.spec import Result, paired_vs_plain


def test_paired_ratios_compare_each_prompt_with_itself():
    """Medians of two configs' rates can come from different prompts (here both 4.0
    tok/s medians, 1.0x); the paired numbers see the 2x and 3x on the slow prompts."""
    plain = Result(rates=[2.0, 4.0, 6.0])
    pld = Result(rates=[4.0, 12.0, 3.0])
    paired = paired_vs_plain(pld, plain)
    assert paired["per_prompt"] == [2.0, 3.0, 0.5]
    assert paired["geomean"] == pytest.approx(math.prod([2.0, 3.0, 0.5]) ** (1 / 3))
    # 100 tokens per prompt: plain 50 + 25 + 16.7 s, pld 25 + 8.3 + 33.3 s
    assert paired["total_time"] == pytest.approx((1 / 2 + 1 / 4 + 1 / 6) / (1 / 4 + 1 / 12 + 1 / 3))


def test_the_draft_configs_with_reduced_and_whole_vocabulary_match_mlx_lm(
    tiny_model_dir, perturbed_draft_dir, tmp_path
):
    """`draft` (the served reduced vocabulary) and `draft-whole` run side by side, on
    engines of their own, against mlx-lm's fixed-k speculation with the whole draft."""
    import json

    from bench import spec

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Once upon a time"}))
    table = spec.main(
        [
            str(tiny_model_dir),
            "--draft-model",
            str(perturbed_draft_dir),
            "--sets",
            str(prompts),
            "--max-tokens",
            "16",
            "--configs",
            "mlx-lm,mlx-lm+draft,plain,draft,draft-whole",
            "--peer-k",
            "2",
            "--draft-vocab",
            "128",
        ]
    )
    rows = table[str(prompts)]
    assert {"mlx-lm+draft k=2", "plain", "draft", "draft-whole"} <= set(rows)
    for config, row in rows.items():
        assert row["greedy_mismatches"] == 0, config
    assert rows["draft"]["drafted"] and rows["draft-whole"]["drafted"]
