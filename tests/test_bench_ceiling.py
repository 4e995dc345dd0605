"""`tandem bench ceiling`: what a prompt lookup draft would get accepted at each output
position, and the replayed policy that knows each match length's acceptance."""

from __future__ import annotations

import json

import pytest

from bench import ceiling
from bench.ceiling import MAX_DRAFT, Costs, Output


def test_each_position_s_lookup_is_scored_against_the_real_output():
    prompt = [1, 2, 3, 4, 1, 2, 3, 4]
    output = [1, 2, 3, 4, 5, 9]
    accepted, matches = ceiling.lookups(prompt, output)
    # "2 3 4" was followed by "1 2 3 4": four tokens right, then 5 is not 1
    assert (accepted[0], matches[0]) == (4, 3)
    assert accepted[4] == 0  # after "... 4", a lookup proposes 1 again; the output says 5
    assert matches[5] == 0  # nothing before ever followed 5


def test_rates_by_match_length_and_the_draft_length_they_predict():
    outputs = [
        Output([0] * 4, accepted=[0, 2, 1, 0], matches=[0, 1, 3, 3]),
        Output([0] * 2, accepted=[6, 0], matches=[3, 1]),
    ]
    expected = ceiling.by_match(outputs)
    assert expected[1] == pytest.approx([0, 0.5, 1, 1, 1, 1, 1, 1, 1])
    assert expected[3][:3] == pytest.approx([0, 2 / 3, 1])
    assert expected[3][MAX_DRAFT] == pytest.approx(7 / 3)
    # two rows, each verify position costing 0.1 plain steps
    costs = Costs({(2, w): 1 + 0.1 * (w - 1) for w in range(1, MAX_DRAFT + 2)})
    # row 0 from a three-token match, row 1 with no lookup: expected tokens 2, 2.67,
    # 3, ..., 4.33 at K = 6 (the longest accepted run) against 1, 1.1, ..., 1.6
    assert ceiling.predicted_best(expected, [3, 0], [50, 50], costs) == 6
    assert ceiling.predicted_best(expected, [0, 0], [50, 50], costs) == 0
    # one token left: nothing to draft
    assert ceiling.predicted_best(expected, [3, 0], [1, 50], costs) == 0


def test_the_report_adds_the_by_match_policy(tiny_model_dir, tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "one two three one two three one two three"}, {"prompt": "a b a b a b"}]
    prompts.write_text("\n".join(json.dumps(row) for row in rows))
    results = ceiling.main(
        [
            str(tiny_model_dir),
            "--dataset",
            str(prompts),
            "--max-tokens",
            "12",
            "--concurrency",
            "1,2",
            "--rounds",
            "1",
            "--repeats",
            "1",
            "--output",
            str(tmp_path / "out.json"),
        ]
    )
    for level in results["levels"].values():
        assert level["by_match_over_plain"] > 0
        assert level["oracle_over_plain"] >= 1.0  # K = 0 is among its choices
    assert "by_match_over_plain" in json.loads((tmp_path / "out.json").read_text())["levels"]["2"]
