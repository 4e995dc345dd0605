"""`tandem draft train MODEL --out DIR`: train an EAGLE-3 drafter for MODEL here.

    tandem draft train MODEL --out DIR [--data PATH] [--prompts N]
        [--time-budget 30m | --steps N] [--seed S] [--seq-len 256] [--batch-size 4]
        [--depth 3] [--draft-vocab 32768]

The target labels its own data (its distribution at every position is the drafter's
soft target), the drafter is trained on its own chains (EAGLE-3's training-time test),
a checkpoint is written every few minutes (`--checkpoint-minutes`) and at the end, and
the same command after a kill resumes from the last one. `DIR` is then a drafter:
`tandem serve MODEL --draft-model DIR`. `tandem draft eval MODEL --draft-model DIR`
measures it against plain decoding and prompt lookup.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from scheduler.prefix_folder import keys_from_file
from training.corpus import Chunks, Record, default_corpus, read_records
from training.stdlib_prompts import stdlib_prompts
from training.trainer import Limits, Settings, Trainer, resumable


def duration(text: str) -> float:
    """Seconds from '90', '90s', '30m', '1.5h'."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([smh]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration such as 30m, 90s or 1.5h")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tandem draft train", description=__doc__)
    parser.add_argument("model", help="the target: a folder, hub id, .gguf or packaged name")
    parser.add_argument("--out", type=Path, required=True, help="the drafter's folder")
    parser.add_argument(
        "--data",
        type=Path,
        help="JSONL (text / prompt / messages records), a folder of text files or one "
        "file (default: the Python standard library's sources)",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=0,
        help="also N chat requests made from the standard library's documented functions "
        "(code to write, functions to explain), answered by the target first and drawn "
        "for half the training chunks: the drafter learns the model's own answers",
    )
    parser.add_argument(
        "--from-traffic",
        nargs="?",
        const="default",
        metavar="PREFIX_CACHE_DIR",
        help="also the server's own traffic: the prompts and answers its prefix cache kept "
        "on disk (the server's --prefix-cache-dir; default its default) for this model, "
        "of the keys in --traffic-key-file only (none: a keyless server's); read, never "
        "copied; needs --traffic-consent",
    )
    parser.add_argument(
        "--traffic-key-file", help="the API keys whose traffic may be used, one per line"
    )
    parser.add_argument(
        "--traffic-consent",
        action="store_true",
        help="the operator's statement that the users of those keys agreed to it",
    )
    parser.add_argument("--time-budget", type=duration, help="stop at a checkpoint by then")
    parser.add_argument("--steps", type=int, help="stop after this many steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=Settings.seq_len)
    parser.add_argument("--batch-size", type=int, default=Settings.batch_size)
    parser.add_argument("--depth", type=int, default=Settings.depth, help="chain steps trained")
    parser.add_argument("--learning-rate", type=float, default=Settings.learning_rate)
    parser.add_argument("--warmup", type=int, default=Settings.warmup)
    parser.add_argument(
        "--draft-vocab", type=int, default=Settings.draft_vocab, help="the head's token count"
    )
    parser.add_argument("--holdout", type=int, default=Settings.holdout, help="chunks held out")
    parser.add_argument(
        "--answer-tokens", type=int, default=Settings.answer_tokens, help="per prompt answered"
    )
    parser.add_argument("--answer-temperature", type=float, default=Settings.answer_temperature)
    parser.add_argument("--max-corpus-tokens", type=int, default=Settings.max_corpus_tokens)
    parser.add_argument("--checkpoint-minutes", type=float, default=5.0)
    parser.add_argument("--checkpoint-steps", type=int)
    parser.add_argument("--eval-every", type=int, default=50, help="steps between estimates")
    args = parser.parse_args(argv)
    if args.steps is None and args.time_budget is None:
        parser.error("give --time-budget (e.g. 30m) or --steps")
    if args.from_traffic and not args.traffic_consent:
        parser.error(
            "--from-traffic trains on what users sent: add --traffic-consent once the "
            "users of those keys have agreed"
        )
    if args.traffic_key_file and not args.from_traffic:
        parser.error("--traffic-key-file is for --from-traffic")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    from engines.model.registry import load_model
    from engines.platform.blas import describe_blas
    from training.answers import answered

    target = load_model(args.model)
    traffic = traffic_folder(args.from_traffic)
    source = args.data or ("" if traffic else default_corpus())
    settings = Settings(
        model=args.model,
        data=str(source),
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        depth=args.depth,
        learning_rate=args.learning_rate,
        warmup=args.warmup,
        draft_vocab=args.draft_vocab,
        seed=args.seed,
        holdout=args.holdout,
        max_corpus_tokens=args.max_corpus_tokens,
        answer_tokens=args.answer_tokens,
        answer_temperature=args.answer_temperature,
        prompts=args.prompts,
        from_traffic=str(traffic or ""),
    )
    saved = resumable(args.out, settings)  # before any work: a mismatched resume is refused
    print(f"target  {args.model} ({target.folder}), BLAS {describe_blas()}", file=sys.stderr)
    records = read_records(Path(source), target.tokenizer) if source else []
    if traffic:
        keys = tuple(keys_from_file(args.traffic_key_file))  # as `tandem serve` reads them
        records += served_traffic(traffic, target, keys)
    if args.prompts:
        records = stdlib_prompts(args.prompts, args.seed, target.tokenizer) + records

    def said(done: int, total: int) -> None:
        print(f"\ranswers {done}/{total} written by the target", end="", file=sys.stderr)

    records = answered(
        records,
        target.model,
        target.tokenizer,
        args.out,
        args.answer_tokens,
        args.answer_temperature,
        args.seed,
        said,
    )
    chunks = Chunks(records, target.tokenizer, args.seq_len, args.holdout, args.max_corpus_tokens)
    print(
        f"\rdata    {describe_sources(source, traffic, args.prompts)}: "
        f"{len(records)} texts, {chunks.tokens:,} tokens, "
        f"{len(chunks.train)} training chunks of {args.seq_len}, {len(chunks.held_out)} "
        "held out",
        file=sys.stderr,
    )
    eos = set(target.tokenizer.eos_token_ids)
    trainer = Trainer(settings, args.out, target.model, target.config, chunks, eos, saved)
    aux = trainer.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    print(
        f"drafter EAGLE-3, one layer over the inputs of target layers {aux}, "
        f"{len(trainer.draft_ids)} draft tokens, step {trainer.progress['step']}"
        f"{' (resumed)' if trainer.progress['step'] else ''}",
        file=sys.stderr,
    )
    limits = Limits(
        steps=args.steps,
        time_budget=args.time_budget,
        checkpoint_seconds=args.checkpoint_minutes * 60,
        checkpoint_steps=args.checkpoint_steps,
        eval_every=args.eval_every,
    )
    report = trainer.run(limits)
    rates = ", ".join(f"{r:.2f}" for r in report.agreement)
    print(
        f"done    {report.steps} steps, {report.tokens:,} tokens in {report.seconds:.0f} s "
        f"(stopped by {report.stopped_by}); loss {report.loss:.3f}\n"
        f"held-out agreement with the target per draft position: {rates} "
        f"(~{report.expected_accepted:.2f} tokens accepted per draft, greedy)\n"
        f"wrote   {args.out} ({report.size_bytes / 1e6:.1f} MB): "
        f"tandem serve {args.model} --draft-model {args.out}",
    )


def traffic_folder(given: str | None) -> Path | None:
    """`--from-traffic`'s folder: the one given, the server's default, or None."""
    if not given:
        return None
    if given == "default":
        from scheduler.prefix_disk import default_directory

        return default_directory()
    return Path(given).expanduser()


def served_traffic(folder: Path, target, keys: tuple[str, ...]) -> list[Record]:
    """The server's traffic for this model and `keys`, as records of token ids."""
    from scheduler.prefix_traffic import NoTraffic, served_identity, traffic_tokens

    try:
        found = traffic_tokens(folder, served_identity(folder, target), keys)
    except NoTraffic as error:
        raise SystemExit(f"--from-traffic: {error}") from error
    if not found:
        whose = f"the {len(keys)} key(s) given" if keys else "a keyless server"
        raise SystemExit(
            f"--from-traffic: {folder} holds no entries of {whose} for this model "
            "(entries are kept for prompts of 256 tokens or more)"
        )
    print(
        f"traffic {len(found)} conversations, {sum(map(len, found)):,} tokens from {folder}",
        file=sys.stderr,
    )
    return [Record("", tokens=tuple(tokens)) for tokens in found]


def describe_sources(source, traffic: Path | None, prompts: int) -> str:
    parts = [str(source)] if source else []
    parts += ["the server's traffic"] if traffic else []
    parts += [f"{prompts} answered requests"] if prompts else []
    return " + ".join(parts)
