"""How much any draft length could gain for one stream, on this machine, with this draft.

`tandem bench spec` measures Tandem's draft-model speculation against mlx-lm's fixed k;
this says how far apart any two length policies can be, so a target such as "1.1x the
best fixed k" can be judged against what is possible. For each prompt it decodes the
target's greedy output once, then at every output position runs the draft greedily
for up to K tokens from the true prefix (teacher-forced), keeping each token's
confidence (the draft's probability for it) and how many of them the target would
accept. With this machine's costs, measured as the engine measures them at start-up
(`CostModel.measure`: target forwards of 1..K+1 tokens and a draft token, against a
pipelined plain step), it replays exact greedy decoding under:

- fixed k = 1..K: what mlx-lm's `speculative_generate_step` does;
- Tandem's confidence stop (`engines.gating.draft_confidence`): drafting stops where one more
  token is not worth its cost, by a calibration learned as it goes from nothing, as a
  fresh server learns it;
- the same stop with the calibration fitted on the whole run first: the best this
  rule could do with a perfect calibration;
- oracle: drafts exactly the tokens that will be accepted (an unreachable bound).

Rates are committed tokens per unit of plain-step cost (prefill left out alike).

    tandem bench draft-ceiling wide-stories --draft-model saltyduckegg --sets novel --limit 6
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from bench.ceiling import greedy_output, publish
from bench.models import resolve_model
from bench.spec import encode_prompt, load_prompts
from engines.drafting.draft_vocab import OwnTokens, bind_own, reduce_draft_vocab
from engines.gating.draft_confidence import ConfidenceCalibration, DraftStop
from engines.gating.measured_costs import CostModel, relative_step_cost
from engines.platform.blas import describe_blas

MAX_DRAFT = 8


@dataclass
class Position:
    """At one output position: the draft's greedy run's confidences and how many of
    its tokens match the target's output from there."""

    confidences: list[float]
    accepted: int


def draft_runs(draft, prompt: list[int], output: list[int], k: int) -> list[Position]:
    """Teacher-forced: at each output position, the draft's k greedy tokens from the
    true prefix (its cache rolled back after each run, then fed the true token). A
    draft with a reduced vocabulary scores the tokens of the context so far, as served."""
    own = OwnTokens()
    cache = make_prompt_cache(draft)
    model = bind_own(draft, [own], [prompt])  # bound to the context so far
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    positions = []
    for position in range(len(output)):
        tokens, confidences, step = [], [], logits
        for i in range(k):
            logprobs = step - mx.logsumexp(step)
            token = int(mx.argmax(logprobs).item())
            tokens.append(token)
            confidences.append(float(mx.exp(logprobs[token]).item()))
            if i + 1 < k:
                step = model(mx.array([[token]]), cache=cache)[0, -1]
        trim_prompt_cache(cache, k - 1)
        accepted = 0
        while accepted < k and position + accepted < len(output):
            if tokens[accepted] != output[position + accepted]:
                break
            accepted += 1
        positions.append(Position(confidences, accepted))
        model = bind_own(draft, [own], [prompt + output[: position + 1]])
        logits = model(mx.array([[output[position]]]), cache=cache)[0, -1]
    return positions


def replay(runs: list[list[Position]], cost: CostModel, choose) -> float:
    """Committed tokens per unit of plain-step cost when `choose(position)` returns
    (draft tokens made, draft tokens verified) at each step."""
    tokens = spent = 0.0
    for positions in runs:
        at = 0
        while at < len(positions):
            here = positions[at]
            made, verified = choose(here)
            accepted = min(here.accepted, verified)
            left = len(positions) - at
            committed = min(accepted + 1, left)
            tokens += committed
            spent += made * cost.draft_step + cost.verify_cost(verified + 1)
            at += committed
    return tokens / spent


def fixed(k: int):
    return lambda position: (k, k)


def oracle(position: Position) -> tuple[int, int]:
    return position.accepted, position.accepted


def confidence_stop(cost: CostModel, calibration: ConfidenceCalibration, learn: bool):
    """Tandem's stop: draft token by token until `DraftStop` says one more would not
    pay, verify its best length; `learn` feeds each verify back, as the engine does."""

    def choose(position: Position) -> tuple[int, int]:
        stop = DraftStop(cost, calibration)
        for confidence in position.confidences:
            if not stop.add(confidence):
                break
        verified = stop.best_length()
        if learn:
            calibration.observe(stop.confidences[:verified], min(position.accepted, verified))
        return len(stop.confidences), verified

    return choose


def fitted_calibration(runs: list[list[Position]]) -> ConfidenceCalibration:
    """A calibration that has seen every position's whole run (as far as it is tried)."""
    calibration = ConfidenceCalibration()
    for positions in runs:
        for position in positions:
            calibration.observe(position.confidences, position.accepted)
    return calibration


def policies(runs: list[list[Position]], cost: CostModel, label: str = "") -> dict[str, float]:
    """Every policy's rate over plain on `runs` at `cost` (names prefixed by `label`)."""
    rates = {f"fixed k={k}": replay(runs, cost, fixed(k)) for k in range(1, MAX_DRAFT + 1)}
    rates["confidence stop, learned"] = replay(
        runs, cost, confidence_stop(cost, ConfidenceCalibration(), learn=True)
    )
    rates["confidence stop, fitted"] = replay(
        runs, cost, confidence_stop(cost, fitted_calibration(runs), learn=False)
    )
    rates["oracle"] = replay(runs, cost, oracle)
    return {f"{label}{name}": rate for name, rate in rates.items()}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    target, tokenizer = load(resolve_model(args.model))
    draft, _ = load(resolve_model(args.draft_model))
    rows = [row for name in args.sets.split(",") for row in load_prompts(name)[: args.limit]]
    reduced = {
        rows_kept: reduce_draft_vocab(draft, tokenizer, rows_kept) for rows_kept in args.draft_vocab
    }
    runs, reduced_runs = [], {n: [] for n in reduced}
    for row in rows:
        prompt = encode_prompt(tokenizer, row)
        output = greedy_output(target, prompt, args.max_tokens, set())
        runs.append(draft_runs(draft, prompt, output, MAX_DRAFT))
        for rows_kept, model in reduced.items():
            reduced_runs[rows_kept].append(draft_runs(model, prompt, output, MAX_DRAFT))
    cost = CostModel.measure(target, draft, MAX_DRAFT + 1, rounds=args.rounds)
    rates = policies(runs, cost)
    best_fixed = max(v for name, v in rates.items() if name.startswith("fixed"))
    draft_costs = {}
    for rows_kept, model in reduced.items():
        ratio = relative_step_cost(model, draft, args.rounds)
        draft_costs[rows_kept] = round(ratio, 4)
        cheaper = CostModel(cost.verify, cost.draft_step * ratio, cost.plain_seconds)
        rates |= policies(reduced_runs[rows_kept], cheaper, f"vocab {rows_kept}: ")
    results = {
        "model": args.model,
        "draft_model": args.draft_model,
        "device": str(mx.default_device()),
        "blas": describe_blas(),
        "sets": args.sets,
        "prompts": len(rows),
        "max_tokens": args.max_tokens,
        "cost": cost.as_dict(),
        "first_token_acceptance": first_token_acceptance(runs),
        "draft_vocab": {
            rows_kept: {
                "draft_cost_vs_whole": draft_costs[rows_kept],
                "first_token_acceptance": first_token_acceptance(reduced_runs[rows_kept]),
            }
            for rows_kept in reduced
        },
        "over_plain": {name: round(rate, 4) for name, rate in rates.items()},
        "over_best_fixed": {name: round(rate / best_fixed, 4) for name, rate in rates.items()},
    }
    return publish(results, report(results), args.output)


def first_token_acceptance(runs: list[list[Position]]) -> float:
    return sum(p.accepted > 0 for r in runs for p in r) / sum(len(r) for r in runs)


def report(results: dict) -> str:
    cost = results["cost"]
    lines = [
        f"model {results['model']}  draft {results['draft_model']}  "
        f"device {results['device']}  BLAS {results['blas']}",
        f"sets {results['sets']} ({results['prompts']} prompts, {results['max_tokens']} "
        f"tokens each); draft's first token accepted at "
        f"{results['first_token_acceptance']:.0%} of positions",
        f"costs vs a plain step: verify 1..{len(cost['verify'])} tokens "
        f"{cost['verify']}, draft token {cost['draft_step']}",
    ]
    for rows_kept, measured in results["draft_vocab"].items():
        lines.append(
            f"vocab {rows_kept}: the draft restricted to the first {rows_kept} ids and the "
            f"special tokens costs {measured['draft_cost_vs_whole']:.2f} of the whole draft; "
            f"first token accepted at {measured['first_token_acceptance']:.0%} of positions"
        )
    lines.append("policy                       over plain  over best fixed k (whole draft)")
    for name, rate in results["over_plain"].items():
        lines.append(f"{name:<40} {rate:>9.3f}x  {results['over_best_fixed'][name]:>16.3f}x")
    lines.append("oracle: knows ahead how many drafted tokens will be accepted (unreachable)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    summary = __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="tandem bench draft-ceiling", description=summary)
    parser.add_argument("model")
    parser.add_argument("--draft-model", required=True)
    parser.add_argument("--sets", default="novel", help="prompt sets or .jsonl files")
    parser.add_argument("--limit", type=int, default=None, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="cost measurement rounds")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument(
        "--draft-vocab",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[],
        help="also replay the draft restricted to its first N ids (comma-separated sizes)",
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
