"""How much prompt lookup could ever gain in a batch, on this machine, for this output.

`tandem bench hybrid` measures what the batched speculative engine gains over plain
batching; this says what any policy could gain at best, so a target can be judged
against what is possible. For each prompt it decodes the greedy output once, then finds
at every position how many tokens a prompt lookup draft (Tandem's own drafter, up to 8
tokens) would have had accepted. It measures this machine's batched forward seconds for
every batch size and width, and replays closed-loop serving at each concurrency three
ways with those costs:

- plain: every step feeds one token per row (what batch-only serving does);
- oracle: every step picks the draft length K that commits most tokens per second,
  knowing exactly what each row's draft would get accepted -- a forward over
  `[B, 1 + K]`, as Tandem's batched verify runs it;
- oracle, no padding: each row drafts exactly what would be accepted and a forward
  costs only its real tokens -- a layout no mlx-lm model runs today, the bound on any
  verify layout;
- by match length: every step picks the K with the best expected tokens per second,
  knowing only how often each position of a lookup draft is accepted by the length of
  the n-gram match that proposed it, over the whole run -- the bound for gates that
  learn those rates perfectly (Tandem's learn the first position's per match length,
  later positions pooled).

The oracle ratios are upper bounds: a real policy cannot know acceptance ahead.

    tandem bench ceiling wide-salty --dataset novel --max-tokens 160 --concurrency 2,4,8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

from bench.models import resolve_model
from bench.serve_dataset import load_prompts
from engines.cache.ragged_cache import RaggedKVCache, feed_rows
from engines.drafting.prompt_lookup import PromptLookupDrafter
from engines.platform.blas import describe_blas
from engines.spec_config import SpecConfig

MAX_DRAFT = 8


@dataclass
class Output:
    """One prompt's greedy output and, per position, the tokens a prompt lookup
    draft made there would have had accepted and the length of the n-gram match that
    proposed it (0: there was none)."""

    tokens: list[int]
    accepted: list[int]
    matches: list[int]


def lookups(prompt: list[int], output: list[int]) -> tuple[list[int], list[int]]:
    """At each output position, the accepted prefix of Tandem's prompt lookup proposal
    (from the prompt and the output so far) against the real next tokens, and the
    match length that proposed it."""
    drafter = PromptLookupDrafter(max_ngram=SpecConfig().pld_max_ngram)
    lengths, matches = [], []
    for position in range(len(output)):
        proposal = drafter.propose(prompt + output[:position], MAX_DRAFT)
        accepted = 0
        for offset, token in enumerate(proposal.tokens if proposal else []):
            if position + offset >= len(output) or output[position + offset] != token:
                break
            accepted += 1
        lengths.append(accepted)
        matches.append(proposal.match_length if proposal else 0)
    return lengths, matches


def by_match(outputs: list[Output]) -> dict[int, list[float]]:
    """Per match length, the expected accepted tokens of a draft of length K = 0..8:
    E[min(accepted, K)] over every position whose lookup that match proposed."""
    seen: dict[int, list[int]] = {}
    for out in outputs:
        for accepted, match in zip(out.accepted, out.matches, strict=True):
            if match:
                seen.setdefault(match, []).append(accepted)
    return {
        match: [statistics.mean(min(a, k) for a in values) for k in range(MAX_DRAFT + 1)]
        for match, values in seen.items()
    }


def greedy_output(model, prompt: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        tokens.append(int(token))
        if int(token) in eos:
            break
    return tokens


def forward_seconds(model, rows: int, width: int, context: int, repeats: int) -> float:
    """Median seconds of one `[rows, width]` forward over ragged caches already
    holding `context` positions per row (rolled back after each try)."""
    cache = [RaggedKVCache([0] * rows) for _ in model.layers]
    mx.eval(feed_rows(model, cache, [[1] * context for _ in range(rows)]))
    times = []
    for _ in range(repeats + 1):  # the first run pays first-use costs
        started = time.perf_counter()
        mx.eval(model(mx.ones((rows, width), dtype=mx.int32), cache=cache))
        times.append(time.perf_counter() - started)
        for layer in cache:
            layer.set_lengths([context] * rows)
    return statistics.median(times[1:])


class Costs:
    """Forward seconds by (rows, width) as measured, and by tokens alone (rows x
    width, interpolated between measured sizes) for the no-padding bound."""

    def __init__(self, table: dict[tuple[int, int], float]) -> None:
        self.table = table
        by_tokens: dict[int, list[float]] = {}
        for (rows, width), seconds in table.items():
            by_tokens.setdefault(rows * width, []).append(seconds)
        self.by_tokens = {n: min(s) for n, s in sorted(by_tokens.items())}

    def step(self, rows: int, width: int) -> float:
        return self.table[rows, width]

    def tokens(self, n: int) -> float:
        sizes = list(self.by_tokens)
        if n in self.by_tokens:
            return self.by_tokens[n]
        low = max((m for m in sizes if m < n), default=sizes[0])
        high = min((m for m in sizes if m > n), default=sizes[-1])
        if high == low:
            return self.by_tokens[low] * n / low
        share = (n - low) / (high - low)
        return self.by_tokens[low] + share * (self.by_tokens[high] - self.by_tokens[low])


def predicted_best(
    expected: dict[int, list[float]], matches: list[int], left: list[int], costs: Costs
) -> int:
    """The draft length with the best expected tokens per second for rows whose lookups
    came from these match lengths (`by_match`), `left[i]` tokens left in row i."""

    def rate(k: int) -> float:
        tokens = sum(
            1 + (expected[m][min(k, n - 1)] if m else 0.0)
            for m, n in zip(matches, left, strict=True)
        )
        return tokens / costs.step(len(matches), 1 + k)

    return max(range(MAX_DRAFT + 1), key=rate)


def replay(outputs: list[Output], order: list[int], concurrency: int, costs: Costs, policy: str):
    """Closed-loop serving of `order` (prompt indices) at `concurrency`: returns
    (tokens, seconds). Prefill is left out alike for every policy."""
    expected = by_match(outputs)
    queue, rows = list(order), []  # rows: [output, position]
    tokens = seconds = 0.0
    while queue or rows:
        while queue and len(rows) < concurrency:
            rows.append([outputs[queue.pop(0)], 0])
        left = [len(out.tokens) - pos for out, pos in rows]
        usable = [min(out.accepted[pos], n - 1) for (out, pos), n in zip(rows, left, strict=True)]
        if policy == "plain":
            commits, cost = [1] * len(rows), costs.step(len(rows), 1)
        elif policy == "flat":
            commits = [1 + a for a in usable]
            cost = costs.tokens(sum(commits))
        elif policy == "by-match":
            matches = [out.matches[pos] for out, pos in rows]
            k = predicted_best(expected, matches, left, costs)
            commits, cost = [1 + min(a, k) for a in usable], costs.step(len(rows), 1 + k)
        else:
            best = None
            for k in range(MAX_DRAFT + 1):
                committed = [1 + min(a, k) for a in usable]
                cost = costs.step(len(rows), 1 + k)
                if best is None or sum(committed) / cost > best[0]:
                    best = (sum(committed) / cost, committed, cost)
            _, commits, cost = best
        seconds += cost
        tokens += sum(commits)
        for row, n in zip(rows, commits, strict=True):
            row[1] += n
        rows = [row for row in rows if row[1] < len(row[0].tokens)]
    return tokens, seconds


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    path = resolve_model(args.model)
    model, tokenizer = load(path)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = load_prompts(args.dataset)[: args.limit]
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    outputs = []
    for prompt in prompts:
        if args.endpoint == "chat":
            ids = tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True)
        else:
            ids = tokenizer.encode(prompt.text)
        tokens = greedy_output(model, ids, args.max_tokens, set() if args.ignore_eos else eos)
        outputs.append(Output(tokens, *lookups(list(ids), tokens)))
    context = int(statistics.mean(len(o.tokens) for o in outputs) / 2) + 16
    table = {
        (rows, width): forward_seconds(model, rows, width, context, args.repeats)
        for rows in range(1, max(levels) + 1)
        for width in range(1, MAX_DRAFT + 2)
    }
    costs = Costs(table)
    results = {
        "model": path,
        "blas": describe_blas(),
        "device": str(mx.default_device()),
        "dataset": args.dataset,
        "max_tokens": args.max_tokens,
        "copyable_share": sum(a > 0 for o in outputs for a in o.accepted)
        / sum(len(o.tokens) for o in outputs),
        "forward_seconds": {f"{r}x{w}": round(s, 5) for (r, w), s in table.items()},
        "levels": {},
    }
    for level in levels:
        order = [i % len(outputs) for i in range(args.rounds * 2 * level)]
        rates = {}
        for policy in ("plain", "oracle", "flat", "by-match"):
            tokens, seconds = replay(outputs, order, level, costs, policy)
            rates[policy] = tokens / seconds
        results["levels"][level] = {
            "plain_tokens_per_s": rates["plain"],
            "oracle_over_plain": rates["oracle"] / rates["plain"],
            "oracle_no_padding_over_plain": rates["flat"] / rates["plain"],
            "by_match_over_plain": rates["by-match"] / rates["plain"],
        }
    return publish(results, report(results), args.output)


def publish(results: dict, text: str, output: Path | None) -> dict:
    """Print the report; write the results as JSON to `output` if given."""
    print(text)
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(results, indent=2))
    return results


def report(results: dict) -> str:
    lines = [
        f"model {results['model']}  device {results['device']}  BLAS {results['blas']}",
        f"dataset {results['dataset']}, up to {results['max_tokens']} tokens; "
        f"{results['copyable_share']:.0%} of output positions had a prompt lookup "
        "draft with at least one token accepted",
        "conc  plain tok/s (replayed)  oracle K per step  oracle, no padding  rates by match",
    ]
    for level, row in results["levels"].items():
        lines.append(
            f"{level:>4}  {row['plain_tokens_per_s']:>22.1f}  "
            f"{row['oracle_over_plain']:>16.2f}x  {row['oracle_no_padding_over_plain']:>17.2f}x"
            f"  {row['by_match_over_plain']:>13.2f}x"
        )
    lines.append(
        "upper bounds: the oracle knows ahead which drafted tokens will be accepted; "
        "rates by match: each match length's acceptance over the whole run"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    summary = __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="tandem bench ceiling", description=summary)
    parser.add_argument("model")
    parser.add_argument("--dataset", default="novel")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--concurrency", default="2,4,8")
    parser.add_argument("--limit", type=int, default=None, help="prompts of the dataset to use")
    parser.add_argument("--rounds", type=int, default=2, help="2 x concurrency requests per round")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per shape")
    parser.add_argument("--output", type=Path, default=None)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
