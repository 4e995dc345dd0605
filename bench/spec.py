"""Speculative speed-up suite at concurrency 1, side by side in one run.

    tandem bench spec MODEL [--draft-model D | --random-drafter KIND | --mtp [--mtp-weights W]]
                            [--num-draft-tokens K] [--sets echo,novel]

For each prompt set it decodes every prompt greedily with:
  mlx-lm      a bare `mlx_lm.generate_step` loop (the framework's own limit)
  mlx-lm+draft  mlx-lm's own `speculative_generate_step`, fixed k (the peer's speculation)
  plain       Tandem's engine with drafting off (k = 0): the server's own overhead
  draft       Tandem with the draft model only (its vocabulary reduced as the server's
              --draft-vocab would, `--draft-vocab` here) -- or with a drafter fed the
              target's hidden states, when --draft-model names one (DFlash, EAGLE-3,
              Gemma-4 assistant; `--random-drafter KIND` writes a random-weight one for
              MODEL: it accepts almost nothing, so its row shows what the gates leave of
              a drafter that does not pay -- close to `plain`)
  draft-whole the same with the draft's whole vocabulary (a second engine, same run)
  pld         Tandem with prompt lookup only
  draft+pld   Tandem with both
  mtp         Tandem drafting with the model's own MTP head (--mtp: Qwen3.5/3.6, Qwen3-Next;
              e.g. `tandem bench spec mlx-community/Qwen3.5-4B-4bit --mtp --mtp-weights
              Qwen/Qwen3.5-4B` on a Mac: converted models lost the head, the original has it)
  mtp+pld     the MTP head and prompt lookup
and prints decode tok/s (median over prompts x repeats), the ratios to mlx-lm and to
Tandem's plain decoding, and acceptance per method. Rows with `messages` (the
code-edit / code-novel sets for instruction models) go through the chat template.
Configurations are interleaved per prompt so drift in machine speed hits them alike.
Every speculative run is checked token-for-token against the mlx-lm output.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

DATA = Path(__file__).parent / "data"
CONFIGS = (
    "mlx-lm",
    "mlx-lm+draft",
    "plain",
    "draft",
    "draft-whole",
    "pld",
    "draft+pld",
    "mtp",
    "mtp+pld",
)


@dataclass
class Result:
    rates: list[float] = field(default_factory=list)
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    mismatches: int = 0

    def count(self, method: str, drafted: int, accepted: int) -> None:
        self.drafted[method] = self.drafted.get(method, 0) + drafted
        self.accepted[method] = self.accepted.get(method, 0) + accepted


def load_prompts(name: str) -> list[dict]:
    path = Path(name) if name.endswith(".jsonl") else DATA / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def encode_prompt(tokenizer, row: dict) -> list[int]:
    """A `messages` row through the model's chat template; a `prompt` row as raw text."""
    if "messages" in row:
        return list(tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True))
    return tokenizer.encode(row["prompt"])


def decode_rate(stamps: list[float], tokens: int) -> float:
    """Tokens after the first over the time after the first (prefill excluded)."""
    return (tokens - 1) / (stamps[-1] - stamps[0])


def rate_of(stamps: list[float], tokens: int, started: float | None) -> float:
    """The decode rate, or with `started` (end-to-end timing) every token over the time
    since the request began: prompt prefill of target and draft included, wherever each
    runner puts it (mlx-lm's speculative loop prefills the draft before its first
    token, Tandem's engine after it, so the first token comes sooner)."""
    if started is None:
        return decode_rate(stamps, tokens)
    return tokens / (stamps[-1] - started)


def timed_tokens(steps, started: float | None = None) -> tuple[float, list[int]]:
    """Rate (see `rate_of`) and tokens of a generator of (token, ...) tuples, as it runs."""
    tokens, stamps = [], []
    for token, *_ in steps:
        tokens.append(token)
        stamps.append(time.perf_counter())
    return rate_of(stamps, len(tokens), started), tokens


def run_mlx_lm(
    model, prompt_ids: list[int], max_tokens: int, e2e: bool = False
) -> tuple[float, list[int]]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    started = time.perf_counter() if e2e else None
    steps = generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens)
    return timed_tokens(steps, started)


def run_mlx_lm_draft(model, draft, prompt_ids, max_tokens, k, e2e=False) -> tuple[float, list]:
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    started = time.perf_counter() if e2e else None
    steps = speculative_generate_step(
        mx.array(prompt_ids), model, draft, num_draft_tokens=k, max_tokens=max_tokens
    )
    return timed_tokens(steps, started)


def run_tandem(
    engine, prompt_ids, max_tokens, overrides, e2e: bool = False
) -> tuple[float, list[int], object]:
    from engines.request import GenerationRequest, SamplingParams
    from engines.sequence import make_sequence

    request = GenerationRequest(
        "bench",
        tuple(prompt_ids),
        max_tokens,
        SamplingParams(temperature=0.0),
        ignore_eos=True,
        speculation=overrides,
    )
    started = time.perf_counter() if e2e else None
    seq = make_sequence(request, engine.registry.tokenizer)
    engine.admit(seq)
    stamps = []
    while engine.active is not None:
        for output in engine.step().outputs:
            stamps.extend([time.perf_counter()] * len(output.token_ids))
    return rate_of(stamps, len(seq.generated), started), seq.generated, seq.spec


def overrides_for(config: str):
    """Which drafters a config turns on; draft lengths stay the engine's own (as a
    server's --num-draft-tokens sets them, with prompt lookup allowed up to the cap)."""
    from engines.request import SpeculationOverrides

    return {
        "plain": SpeculationOverrides(num_draft_tokens=0),
        "draft": SpeculationOverrides(enable_pld=False, enable_draft=True),
        "draft-whole": SpeculationOverrides(enable_pld=False, enable_draft=True),
        "pld": SpeculationOverrides(enable_pld=True, enable_draft=False),
        "draft+pld": SpeculationOverrides(enable_pld=True, enable_draft=True),
        "mtp": SpeculationOverrides(enable_pld=False, enable_draft=True),
        "mtp+pld": SpeculationOverrides(enable_pld=True, enable_draft=True),
    }[config]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="tandem bench spec", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model path/hub id, or random-100m / wide-stories")
    parser.add_argument(
        "--draft-model", help="draft model or feature drafter folder (the draft configs)"
    )
    parser.add_argument(
        "--random-drafter",
        choices=("dflash", "eagle3", "assistant"),
        help="a random-weight drafter of this kind for MODEL (what gating leaves of it)",
    )
    parser.add_argument(
        "--mtp", action="store_true", help="draft with the model's MTP head (the mtp configs)"
    )
    parser.add_argument("--mtp-weights", help="where the mtp.* weights are (file, folder, hub id)")
    parser.add_argument(
        "--num-draft-tokens", type=int, help="Tandem's cap (default: the server's default)"
    )
    parser.add_argument("--sets", default="echo,novel", help="prompt sets or .jsonl files")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--limit", type=int, default=0, help="prompts per set (0 = all)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--e2e",
        action="store_true",
        help="rates over each request's whole time, prompt prefill of target and draft "
        "included (default: decode rate after the first token)",
    )
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help="which of: " + ", ".join(CONFIGS)
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="fresh engines (each measuring its costs at start-up, like a fresh server)",
    )
    parser.add_argument(
        "--peer-k", default="", help="mlx-lm+draft's fixed k values (default: --num-draft-tokens)"
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="Tandem's draft scores only this many frequent tokens, as `tandem serve "
        "--draft-vocab` (default: the server's automatic size; 0 = all)",
    )
    args = parser.parse_args(argv)
    if sum(map(bool, (args.mtp, args.draft_model, args.random_drafter))) > 1:
        parser.error("--mtp, --draft-model, --random-drafter: one model drafter at a time")

    import mlx.core as mx

    from bench.models import resolve_model
    from engines.drafting.draft_vocab import describe_vocabulary, reduce_draft_vocab
    from engines.drafting.feature_drafters import drafter_kind, load_feature_drafter
    from engines.model.registry import ModelRegistry
    from engines.platform.blas import describe_blas

    model_path = resolve_model(args.model)
    draft_path = resolve_model(args.draft_model) if args.draft_model else None
    if args.random_drafter:
        draft_path = str(random_drafter(args.random_drafter, model_path))
    kind = drafter_kind(draft_path) if draft_path else None
    registry = ModelRegistry.load(model_path, draft_path if kind == "model" else None)
    if kind not in (None, "model"):  # its rows are `draft`; no draft LM for mlx-lm's rows
        registry.feature_drafter = load_feature_drafter(draft_path, kind, registry.target)
    whole_draft = registry.draft.model if registry.draft else None  # mlx-lm's, draft-whole's
    if registry.draft:
        registry.draft.model = reduce_draft_vocab(whole_draft, registry.tokenizer, args.draft_vocab)
    if args.mtp:
        from engines.model.mtp import load_head, local_folder, weights_source

        weights = weights_source(args.mtp_weights) if args.mtp_weights else None
        target = registry.target
        registry.mtp = load_head(target.model, target.config, local_folder(target.folder), weights)
    tokenizer = registry.tokenizer
    wanted = args.configs.split(",")
    peer_ks = [int(k) for k in args.peer_k.split(",") if k] or [args.num_draft_tokens or 4]
    configs = []
    for config in CONFIGS:
        if config not in wanted or (not draft_path and "draft" in config):
            continue
        if whole_draft is None and config in ("mlx-lm+draft", "draft-whole"):
            continue  # a feature drafter: mlx-lm has no such drafter, nor a whole/reduced pair
        if config.startswith("mtp") and not args.mtp:
            continue
        configs += [f"{config} k={k}" for k in peer_ks] if config == "mlx-lm+draft" else [config]
    if "mlx-lm" not in configs:
        configs.insert(0, "mlx-lm")  # the reference every output is checked against

    print(f"model   {args.model} -> {model_path}")
    print(f"draft   {args.draft_model or args.random_drafter} -> {draft_path} ({kind})")
    if registry.feature_drafter is not None:
        print(f"drafter {registry.feature_drafter.describe()}")
    if args.mtp:
        print(f"mtp     the model's own head, weights from {args.mtp_weights or 'the model'}")
    print(
        f"device  {mx.default_device()}  BLAS {describe_blas()}  "
        f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}"
    )
    print(
        f"run     greedy, max_tokens={args.max_tokens}, repeats={args.repeats}, "
        f"{'end-to-end rates (prefill included)' if args.e2e else 'decode rates'}, "
        f"k<={args.num_draft_tokens or 'server default'}, "
        f"{args.runs} run(s) with a fresh engine each"
    )
    if whole_draft is not None:
        hello = tokenizer.encode("Hello")
        target_rate, _ = run_mlx_lm(registry.target.model, hello, 32)
        draft_rate, _ = run_mlx_lm(whole_draft, hello, 32)
        reduced_rate, _ = run_mlx_lm(registry.draft.model, hello, 32)
        scoring = describe_vocabulary(registry.draft.model)
        print(
            f"cost    draft/target per token {target_rate / draft_rate:.2f} (plain decode), "
            f"Tandem's draft {target_rate / reduced_rate:.2f} (scoring {scoring})"
        )

    runs = []
    for run in range(args.runs):
        engine = fresh_engine(registry, args.num_draft_tokens)
        engines = {"": engine}
        if "draft-whole" in configs:
            engines["whole"] = fresh_engine(registry, args.num_draft_tokens, whole_draft)
        print(f"engine  run {run + 1}: {engine.describe()}")
        runs.append(run_sets(engines, registry, whole_draft, configs, args))
    return report(runs, args.json)


def random_drafter(kind: str, model_path: str) -> Path:
    """A random-weight drafter of `kind` for the model at `model_path` (a local folder),
    written once beside Tandem's other cached benchmark files."""
    from bench.drafter_checkpoints import write_assistant, write_dflash, write_eagle3
    from engines.model.cache_paths import tandem_cache_root

    config = json.loads((Path(model_path) / "config.json").read_text())
    layers = config.get("text_config", config)["num_hidden_layers"]
    out = tandem_cache_root() / "bench-drafters" / f"{Path(model_path).name}-{kind}"
    if (out / "config.json").exists():
        return out
    if kind == "dflash":
        return write_dflash(out, Path(model_path), layer_ids=(1, layers // 2, layers - 2))
    if kind == "eagle3":
        return write_eagle3(out, Path(model_path))
    return write_assistant(out, Path(model_path))


def fresh_engine(registry, k: int | None, draft_model=None):
    """A speculative engine as a fresh server builds it: costs measured at start-up;
    with `draft_model`, drafting with that instead of the registry's draft."""
    from engines.single.engine import SpeculativeEngine
    from engines.spec_config import SpecConfig

    served = registry.draft.model if registry.draft else None
    if draft_model is not None:
        registry.draft.model = draft_model
    try:
        engine = SpeculativeEngine(registry, SpecConfig.for_server(k))
    finally:
        if draft_model is not None:
            registry.draft.model = served
    registry.transfer(engine.name)
    return engine


def run_sets(
    engines: dict, registry, whole_draft, configs: list[str], args
) -> dict[str, dict[str, Result]]:
    """Every prompt of every set through every config, interleaved per prompt
    (`engines[""]` the served engine, `engines["whole"]` draft-whole's)."""
    tokenizer, target = registry.tokenizer, registry.target.model
    results: dict[str, dict[str, Result]] = {}
    for set_name in args.sets.split(","):
        rows = load_prompts(set_name)[: args.limit or None]
        results[set_name] = {c: Result() for c in configs}
        run_mlx_lm(target, encode_prompt(tokenizer, rows[0]), 8)  # warm-up
        for _ in range(args.repeats):
            for number, row in enumerate(rows, start=1):
                prompt_ids = encode_prompt(tokenizer, row)
                rate, reference = run_mlx_lm(target, prompt_ids, args.max_tokens, args.e2e)
                results[set_name]["mlx-lm"].rates.append(rate)
                progress = [f"mlx-lm {rate:.2f}"]
                for config in configs[1:]:
                    result = results[set_name][config]
                    engine = engines["whole" if config == "draft-whole" else ""]
                    rate, tokens, spec = run_config(
                        config, engine, registry, whole_draft, prompt_ids, args
                    )
                    progress.append(f"{config} {rate:.2f}")
                    result.rates.append(rate)
                    result.mismatches += tokens != reference
                    for method, stats in spec.by_method.items() if spec else ():
                        result.count(method, stats.draft_tokens, stats.accepted_tokens)
                print(f"  {set_name} #{number} tok/s: " + ", ".join(progress), flush=True)
    return results


def run_config(config: str, engine, registry, whole_draft, prompt_ids: list[int], args):
    """(decode rate, tokens, Tandem's speculation stats or None) of one config; mlx-lm's
    speculation drafts with the whole draft model, as mlx-lm ships."""
    if config.startswith("mlx-lm+draft"):
        k = int(config.rsplit("=", 1)[1])
        target = registry.target.model
        return *run_mlx_lm_draft(
            target, whole_draft, prompt_ids, args.max_tokens, k, args.e2e
        ), None
    overrides = overrides_for(config)
    return run_tandem(engine, prompt_ids, args.max_tokens, overrides, args.e2e)


def merged(runs: list[dict[str, dict[str, Result]]]) -> dict[str, dict[str, Result]]:
    """All runs' samples per set and config."""
    total: dict[str, dict[str, Result]] = {}
    for results in runs:
        for set_name, by_config in results.items():
            for config, result in by_config.items():
                into = total.setdefault(set_name, {}).setdefault(config, Result())
                into.rates += result.rates
                into.mismatches += result.mismatches
                for method in result.drafted:
                    into.count(method, result.drafted[method], result.accepted[method])
    return total


def report(runs: list[dict[str, dict[str, Result]]], json_path: Path | None) -> dict:
    table: dict = {}
    print()
    print(
        f"{'set':10} {'config':16} {'tok/s':>7} {'vs mlx-lm':>9} {'vs plain':>8}"
        "  acceptance (accepted/drafted)"
    )
    by_set = merged(runs)
    for set_name, by_config in by_set.items():
        base = statistics.median(by_config["mlx-lm"].rates)
        plain = statistics.median(by_config["plain"].rates) if "plain" in by_config else None
        for config, result in by_config.items():
            rate = statistics.median(result.rates)
            acceptance = "  ".join(
                f"{m} {result.accepted[m]}/{result.drafted[m]}"
                f" ({result.accepted[m] / max(result.drafted[m], 1):.0%})"
                for m in sorted(result.drafted)
            )
            flag = f"  MISMATCH x{result.mismatches}" if result.mismatches else ""
            vs_plain = f"{rate / plain:7.2f}x" if plain else f"{'-':>8}"
            print(
                f"{set_name:10} {config:16} {rate:7.2f} {rate / base:8.2f}x {vs_plain}"
                f"  {acceptance}{flag}"
            )
            table.setdefault(set_name, {})[config] = {
                "tok_s": rate,
                "ratio_vs_mlx_lm": rate / base,
                "ratio_vs_plain": rate / plain if plain else None,
                "runs": result.rates,
                "drafted": result.drafted,
                "accepted": result.accepted,
                "greedy_mismatches": result.mismatches,
            }
    report_paired(by_set, table)
    if len(runs) > 1:
        table["per_run"] = report_runs(runs)
    if json_path:
        json_path.write_text(json.dumps(table, indent=2))
    return table


def paired_vs_plain(result: Result, plain: Result) -> dict:
    """Each prompt's speed-up over plain on the same prompt (they ran back to back), their
    geometric mean, and the ratio of the time all prompts took (each generates the same
    tokens in both configs): the medians of two configs' rates can come from different
    prompts, these cannot."""
    ratios = [rate / base for rate, base in zip(result.rates, plain.rates, strict=True)]
    geomean = math.exp(statistics.fmean(math.log(r) for r in ratios))
    total_time = sum(1 / r for r in plain.rates) / sum(1 / r for r in result.rates)
    return {"per_prompt": ratios, "geomean": geomean, "total_time": total_time}


def report_paired(by_set: dict[str, dict[str, Result]], table: dict) -> None:
    print()
    for set_name, by_config in by_set.items():
        if "plain" not in by_config:
            continue
        for config, result in by_config.items():
            if config == "plain":
                continue
            paired = paired_vs_plain(result, by_config["plain"])
            table[set_name][config]["paired_vs_plain"] = paired
            per_prompt = ", ".join(f"{r:.2f}" for r in paired["per_prompt"])
            print(
                f"{set_name:10} {config:16} vs plain, prompt by prompt: [{per_prompt}]  "
                f"geomean {paired['geomean']:.2f}x  total time {paired['total_time']:.2f}x"
            )


def report_runs(runs: list[dict[str, dict[str, Result]]]) -> dict:
    """Per fresh engine: each Tandem config's speed-up over plain and over mlx-lm's best
    fixed-k speculation, with the median and the spread (max/median - 1) over runs."""
    out: dict = {}
    print()
    for set_name in runs[0]:
        for config in runs[0][set_name]:
            if config in ("mlx-lm", "plain") or config.startswith("mlx-lm+draft"):
                continue
            vs_plain, vs_peer = [], []
            for results in runs:
                by_config = results[set_name]
                rate = statistics.median(by_config[config].rates)
                if "plain" in by_config:
                    vs_plain.append(rate / statistics.median(by_config["plain"].rates))
                peers = [r for c, r in by_config.items() if c.startswith("mlx-lm+draft")]
                if peers:
                    vs_peer.append(rate / max(statistics.median(r.rates) for r in peers))
            row = {"vs_plain": vs_plain, "vs_best_mlx_lm_draft": vs_peer}
            out.setdefault(set_name, {})[config] = row
            for name, values in row.items():
                if values:
                    middle = statistics.median(values)
                    spread = max(abs(v / middle - 1) for v in values)
                    runs_text = ", ".join(f"{v:.2f}" for v in values)
                    print(
                        f"{set_name:10} {config:10} {name:22} median {middle:.2f}x  "
                        f"min {min(values):.2f}x  spread ±{spread:.0%}  runs [{runs_text}]"
                    )
    return out


if __name__ == "__main__":
    main()
