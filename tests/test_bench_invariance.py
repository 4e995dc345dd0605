"""`tandem bench invariance`: a verify's logits against plain steps', per dtype, on this
device. On the CPU and on a GPU with TF32 off, float32 agrees to rounding."""

from __future__ import annotations

import json

import mlx.core as mx
from mlx_lm import load

from bench.batch_invariance import main, verify_against_plain


def test_float32_verify_logits_equal_plain_steps_to_rounding(tiny_model_dir):
    model, _ = load(str(tiny_model_dir))
    tokens = mx.random.randint(3, 500, (1, 40), key=mx.random.key(0))
    block, single = verify_against_plain(model, tokens, prefix=32, positions=8)
    assert block.shape == single.shape == (1, 8, model.args.vocab_size)
    assert mx.abs(block - single).max().item() < 1e-4
    assert (block.argmax(-1) == single.argmax(-1)).all().item()


def test_the_command_reports_each_dtype(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "invariance.json"
    main([str(tiny_model_dir), "--dtypes", "float32,bfloat16", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [row["dtype"] for row in rows] == ["float32", "bfloat16"]
    assert rows[0]["greedy_flips"] == 0 and rows[0]["max_logit_difference"] < 1e-4
    assert "float32 matmuls full" in capsys.readouterr().out
