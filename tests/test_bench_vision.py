"""`tandem bench vision` runs end to end (Tandem alone here: mlx-vlm's server needs a
venv of its own), and its rows say what was measured."""

from __future__ import annotations

import json

from bench.vision import main
from tests.vlm_models import build_idefics3


def test_vision_bench_measures_cold_and_cached_first_tokens(tmp_path, capsys):
    model = build_idefics3(tmp_path / "vlm")
    main([str(model), "--peer", "none", "--images", "2"])
    out = capsys.readouterr().out
    row = json.loads(out.splitlines()[0])
    assert row["server"] == "tandem" and len(row["cold"]) == len(row["cached"]) == 2
    assert all(seconds > 0 for seconds in [*row["cold"], *row["cached"]])
    assert "BLAS" in out and "TTFT cold s" in out
