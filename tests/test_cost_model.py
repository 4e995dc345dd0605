"""The single-stream cost model: measured robustly at start-up on a noisy machine,
corrected by the engine's own steps, and shown in /v1/stats and /metrics.

The start-up measurement is driven through a real tiny model whose forwards are made to
cost a known time (a sleep proportional to the tokens fed), so the true cost ratios are
known and the machine's own speed, drifting or disturbed, can be simulated."""

from __future__ import annotations

import time

import pytest
from mlx_lm import load

from engines.gates import CostModel, OnlineCosts, monotone_fit
from tests.conftest import make_client


class TimedModel:
    """A real model whose forward over n tokens takes (fixed + per_token * n) seconds
    times `slowdown(call number)`: a machine of known, controllable speed."""

    def __init__(self, model, fixed: float, per_token: float, slowdown) -> None:
        self.model, self.fixed, self.per_token, self.slowdown = model, fixed, per_token, slowdown
        self.calls = 0

    def __call__(self, tokens, cache=None):
        self.calls += 1
        time.sleep((self.fixed + self.per_token * tokens.shape[1]) * self.slowdown(self.calls))
        return self.model(tokens, cache=cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def true_verify(n: int, fixed: float, per_token: float) -> float:
    return (fixed + per_token * n) / (fixed + per_token)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))[0]


@pytest.mark.parametrize(
    "slowdown",
    [
        pytest.param(lambda call: 1.0 + call / 200, id="machine slowing down by half"),
        pytest.param(lambda call: 4.0 if 30 <= call < 45 else 1.0, id="burst of interference"),
    ],
)
def test_startup_costs_are_right_on_a_drifting_or_disturbed_machine(tiny, slowdown):
    fixed, per_token = 0.020, 0.005  # sleeps well above the tiny model's own compute
    model = TimedModel(tiny, fixed, per_token, slowdown)
    draft = TimedModel(tiny, 0.008, 0.0, lambda call: 1.0)
    cost = CostModel.measure(model, draft, max_tokens=9)
    for n in range(1, 10):
        expected = true_verify(n, fixed, per_token)
        assert cost.verify_cost(n) == pytest.approx(expected, rel=0.12), (n, cost.verify)
    assert cost.draft_step == pytest.approx(0.008 / (fixed + per_token), rel=0.2)
    assert list(cost.verify) == sorted(cost.verify)


def test_monotone_fit_averages_a_noisy_size_with_its_neighbours():
    assert monotone_fit([1.0, 1.5, 1.2, 1.6]) == pytest.approx([1.0, 1.35, 1.35, 1.6])
    # one noisy size does not lift every larger size to its level (a running max would)
    fitted = monotone_fit([1.0, 2.2, 1.1, 1.2, 1.3, 1.4])
    assert fitted[-1] < 1.6 and fitted == sorted(fitted)
    assert monotone_fit([1.0, 1.1, 1.2]) == [1.0, 1.1, 1.2]


def test_a_pessimistic_startup_measurement_is_corrected_by_real_steps():
    """Start-up said verifying 3 tokens costs 2.5 plain steps; the engine's own steps say
    1.1. After a few steps the gates use what the steps say."""
    costs = OnlineCosts(CostModel((1.0, 2.0, 2.5, 2.6), draft_step=0.5))
    for _ in range(8):
        costs.observe_plain(0.010)
        costs.observe_verify(3, 0.011)
        costs.observe_draft(2, 0.004)
    model = costs.model()
    assert model.verify_cost(3) == pytest.approx(1.1, rel=0.02)
    assert model.verify_cost(2) <= model.verify_cost(3)  # still non-decreasing
    # sizes never verified: the start-up shape, scaled by how far off it was at size 3
    assert 1.1 <= model.verify_cost(4) < 1.2
    assert model.draft_step == pytest.approx(0.2, rel=0.02)
    snapshot = costs.snapshot()
    assert snapshot["measured_at_startup"]["verify"][2] == 2.5
    assert snapshot["verify"][2] == pytest.approx(1.1, rel=0.02)
    assert snapshot["samples"]["v3"] == 8


async def test_the_costs_in_use_are_in_stats_and_metrics(spec_scheduler):
    async with make_client(spec_scheduler) as client:
        stats = (await client.get("/v1/stats")).json()
        metrics = (await client.get("/metrics")).text
    costs = stats["speculation"]["costs"]
    expected = CostModel.assumed(9)  # what the test schedulers are given
    assert costs["verify"] == pytest.approx(list(expected.verify), abs=1e-4)
    assert costs["draft_step"] == pytest.approx(expected.draft_step)
    assert costs["learning"] is False
    label = f'model_name="{stats["model"]}"'
    for n, cost in enumerate(expected.verify, start=1):
        line = f'tandem_spec_verify_cost_ratio{{{label},tokens="{n}"}} {round(cost, 4)}\n'
        assert line in metrics
    assert f"tandem_spec_draft_step_cost_ratio{{{label}}} {expected.draft_step}\n" in metrics
