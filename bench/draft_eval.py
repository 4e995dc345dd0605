"""`tandem draft eval MODEL --draft-model DIR`: what a drafter gives, side by side.

    tandem draft eval MODEL --draft-model DIR [--sets novel,code-novel | FILE.jsonl]
        [--max-tokens 128] [--limit N] [--repeats 1] [--json OUT]

Each prompt is decoded greedily, one request at a time, by mlx-lm's own loop (the
reference every output is checked against), Tandem with drafting off (`plain`),
Tandem with prompt lookup alone (`pld`) and Tandem with the drafter alone (`draft`),
one after the other per prompt so machine drift hits them alike. It prints decode tok/s
(median over prompts), each config's speed-up over plain (prompt by prompt, geometric
mean), and for the drafter its acceptance per draft position (the share of its drafts
whose first i tokens were all accepted) and tokens accepted per draft. Any output that
differs from mlx-lm's is counted and printed: the drafter must never change a token.
Give prompts the drafter was not trained on (`--sets` takes JSONL files of `prompt` or
`messages` rows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

CONFIGS = ("plain", "pld", "draft")


@dataclass
class Row:
    rates: list[float] = field(default_factory=list)
    mismatches: int = 0
    drafts: int = 0
    accepted: int = 0
    positions: list[int] = field(default_factory=list)  # drafts accepted through position i

    def add_spec(self, spec) -> None:
        for stats in spec.by_method.values():
            self.drafts += stats.drafts
            self.accepted += stats.accepted_tokens
        for i, count in enumerate(spec.accepted_per_position):
            if i == len(self.positions):
                self.positions.append(0)
            self.positions[i] += count


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tandem draft eval", description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--draft-model", required=True, help="the drafter's folder")
    parser.add_argument("--sets", default="novel,echo", help="prompt sets or .jsonl files")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=0, help="prompts per set (0 = all)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import mlx.core as mx

    from bench.models import resolve_model
    from bench.spec import (
        encode_prompt,
        fresh_engine,
        load_prompts,
        overrides_for,
        run_mlx_lm,
        run_tandem,
    )
    from engines.drafting.feature_drafters import drafter_kind, load_feature_drafter
    from engines.model.registry import ModelRegistry
    from engines.platform.blas import describe_blas

    model_path = resolve_model(args.model)
    kind = drafter_kind(args.draft_model)
    registry = ModelRegistry.load(model_path, args.draft_model if kind == "model" else None)
    if kind != "model":
        registry.feature_drafter = load_feature_drafter(args.draft_model, kind, registry.target)
    engine = fresh_engine(registry, None)
    print(f"model   {args.model} -> {model_path}")
    print(f"drafter {args.draft_model} ({kind})")
    print(f"device  {mx.default_device()}  BLAS {describe_blas()}  "
          f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}")  # fmt: skip
    print(
        f"run     greedy, max_tokens={args.max_tokens}, one request at a time; {engine.describe()}"
    )
    table: dict = {}
    for set_name in args.sets.split(","):
        rows = {c: Row() for c in ("mlx-lm", *CONFIGS)}
        prompts = load_prompts(set_name)[: args.limit or None]
        run_mlx_lm(registry.target.model, encode_prompt(registry.tokenizer, prompts[0]), 8)
        for _ in range(args.repeats):
            for row in prompts:
                prompt_ids = encode_prompt(registry.tokenizer, row)
                rate, reference = run_mlx_lm(registry.target.model, prompt_ids, args.max_tokens)
                rows["mlx-lm"].rates.append(rate)
                for config in CONFIGS:
                    rate, tokens, spec = run_tandem(
                        engine, prompt_ids, args.max_tokens, overrides_for(config)
                    )
                    rows[config].rates.append(rate)
                    rows[config].mismatches += tokens != reference
                    if config == "draft":
                        rows[config].add_spec(spec)
        table[set_name] = report(set_name, rows)
    if args.json:
        args.json.write_text(json.dumps(table, indent=2))
    return table


def report(set_name: str, rows: dict[str, Row]) -> dict:
    plain = rows["plain"].rates
    out = {}
    print(f"\n{set_name}: {len(plain)} prompts")
    for config, row in rows.items():
        ratios = [r / p for r, p in zip(row.rates, plain, strict=True)]
        geomean = math.exp(statistics.fmean(math.log(r) for r in ratios))
        line = f"  {config:7} {statistics.median(row.rates):8.1f} tok/s  {geomean:5.2f}x plain"
        if row.mismatches:
            line += f"  MISMATCH x{row.mismatches}"
        out[config] = {"tok_s": statistics.median(row.rates), "vs_plain": geomean,
                       "mismatches": row.mismatches}  # fmt: skip
        if config == "draft" and row.drafts:
            rates = [count / row.drafts for count in row.positions]
            per = ", ".join(f"{r:.0%}" for r in rates[:8])
            line += f"  accepted per position {per}; {row.accepted / row.drafts:.2f} per draft"
            out[config] |= {"acceptance_per_position": rates,
                            "accepted_per_draft": row.accepted / row.drafts}  # fmt: skip
        print(line)
    return out


if __name__ == "__main__":
    main()
