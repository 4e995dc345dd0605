"""Packed verifies: the token-wise layers run on a padded batch's real tokens only,
and every real position's logits are what the padded forward gives."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm import load

from engines.batch_costs import BatchCosts, RowOption, choose_draft_length
from engines.gates import CostModel
from engines.packed_tokens import PackedTokens
from engines.ragged_cache import RaggedKVCache, feed_rows

PROMPTS = [[5, 9, 12, 30, 7, 7, 3], [11, 4], [8, 8, 8, 2, 19]]


def prefilled(model) -> list[RaggedKVCache]:
    cache = [RaggedKVCache([0] * len(PROMPTS)) for _ in model.layers]
    mx.eval(feed_rows(model, cache, PROMPTS))
    return cache


def verify_logits(model, fed: list[list[int]], packing: PackedTokens | None) -> mx.array:
    """One `[B, W]` forward of `fed` (padded at the end) over fresh prefilled caches."""
    cache = prefilled(model)
    width = max(len(row) for row in fed)
    inputs = mx.array([row + [0] * (width - len(row)) for row in fed])
    if packing is None:
        return model(inputs, cache=cache)
    with packing.feeding([len(row) for row in fed], width):
        return model(inputs, cache=cache)


def test_packed_verify_gives_every_real_position_the_padded_forwards_logits(tiny_model_dir):
    plain_model, _ = load(str(tiny_model_dir))
    model, _ = load(str(tiny_model_dir))
    packing = PackedTokens.install(model)
    fed = [[3, 14, 15, 9, 2, 6], [5], [35, 8]]
    padded = verify_logits(plain_model, fed, None)
    packed = verify_logits(model, fed, packing)
    for i, row in enumerate(fed):
        assert mx.allclose(packed[i, : len(row)], padded[i, : len(row)], atol=1e-5).item()
    assert not mx.allclose(packed[1, 1:], padded[1, 1:]).item(), "padding was not computed"


def test_wrapping_keeps_parameters_classes_and_every_unpacked_forward(tiny_model_dir):
    plain_model, _ = load(str(tiny_model_dir))
    model, _ = load(str(tiny_model_dir))
    names = [name for name, _ in tree_flatten(model.parameters())]
    packing = PackedTokens.install(model)
    assert PackedTokens.install(model) is packing, "a second install reuses the first"
    assert [name for name, _ in tree_flatten(model.parameters())] == names
    wrapped = [m for _, m in model.named_modules() if type(m).__name__.startswith("Packed")]
    assert wrapped and all(isinstance(m, nn.Linear | nn.Embedding) for m in wrapped)
    fed = [[3, 14, 15], [5, 0, 0], [35, 8, 1]]  # no packing outside `feeding`
    assert mx.array_equal(verify_logits(model, fed, None), verify_logits(plain_model, fed, None))


def test_once_padding_is_measured_cheap_one_copying_row_drafts_long_beside_rows_that_do_not():
    """Eight rows, one copying its context (95% acceptance), seven that are not (10%).
    Padded, every row pays for the copier's 8 drafts and the batch decodes plainly;
    once packed forwards show padding costs little, the copier drafts alone."""
    costs = BatchCosts(CostModel.assumed(9, per_token=0.02), explore_every=1000)
    for _ in range(costs.min_samples):
        for tokens in (8, 16, 72):
            costs.observe_target(tokens, 0.060 + 0.004 * tokens)
    plain = costs.plain_plan(8)
    for _ in range(costs.min_samples):  # plain steps served as predicted
        costs.observe_outcome(8, plain, 8, plain.cost)
    options = [[RowOption(0.95, 8, False)]] + [[RowOption(0.1, 8, False)] for _ in range(7)]
    assert choose_draft_length(costs, options, 8).k == 0
    for _ in range(costs.min_samples):  # 16 real tokens padded to 72 positions
        costs.observe_target(16, 0.060 + 0.004 * 16 + 0.0002 * 56, padded=56)
    plan = choose_draft_length(costs, options, 8)
    assert plan.lengths[0] >= 6 and sum(plan.lengths[1:]) == 0
    assert plan.forward == 8 + plan.lengths[0]
