"""`python -m bench.drafter_cost`: each downloaded-drafter kind's proposal timed against
a plain step of the same target, at each row count, as the device check's stage runs it."""

from __future__ import annotations

import json

from bench.drafter_cost import main


def test_every_kind_that_fits_is_timed_at_every_row_count(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "cost.json"
    args = [str(tiny_model_dir), "--rows", "1,3", "--context", "16", "--repeats", "1"]
    result = main([*args, "--json", str(out)])
    assert result["kinds"] == ["dflash", "eagle3"]  # a Llama: no Gemma-4 assistant
    assert [row["rows"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert all(row[name] > 0 for name in ("target", "verify", "dflash", "eagle3"))
    assert json.loads(out.read_text()) == result
    printed = capsys.readouterr().out
    assert "BLAS" in printed and "dflash/target" in printed and "eagle3/target" in printed
