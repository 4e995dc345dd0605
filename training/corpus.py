"""The text a drafter is trained on, as fixed-length token chunks in a seeded order.

Sources (`--data`): a JSONL file whose records are documents (`text`), prompts the
target answers itself (`prompt`, or chat `messages` rendered with the model's template:
`training.answers` writes the answers), or both (`prompt` + `completion`/`response`);
a folder of text files; one text file. Without `--data`: the Python standard library's
own sources, which are on every machine that runs Tandem (a fit for code models; for
others, give text or prompts of the kind the model will serve). Requests made from the
standard library (`training.stdlib_prompts`, `--prompts`) and the server's own traffic
(`scheduler.prefix_traffic`, `--from-traffic`) come as records too.

Documents are tokenized one at a time, joined by the end-of-sequence token and cut
into chunks of `length` tokens; the order is a seeded shuffle per pass, and a chunk's
place in it depends only on the seed and the corpus, so a resumed run skips exactly
the chunks it had trained on. Every `HOLDOUT_EVERY`-th chunk is held out (up to
`holdout` of them) for the acceptance estimate and never trained on.
"""

from __future__ import annotations

import json
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TEXT_SUFFIXES = {".py", ".md", ".txt", ".rst", ".js", ".ts", ".c", ".h", ".rs", ".go", ".java"}
HOLDOUT_EVERY = 50
MAX_FILE_BYTES = 1 << 20  # a larger file is data, not text


@dataclass(frozen=True)
class Record:
    """One training text: a document, or a prompt with its answer (None: the target
    writes it)."""

    text: str
    answer: str | None = None
    is_prompt: bool = False
    tokens: tuple[int, ...] | None = None  # served traffic, as the server kept it

    @property
    def is_served(self) -> bool:
        """What the model writes when asked: an answered prompt, or served traffic."""
        return self.is_prompt or self.tokens is not None


def default_corpus() -> Path:
    """The Python standard library's sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def read_records(source: Path, tokenizer: Any) -> list[Record]:
    """The records of `source` (see the module), in a stable order."""
    if source.is_dir():
        files = sorted(
            p
            for p in source.rglob("*")
            if p.suffix in TEXT_SUFFIXES
            and p.is_file()
            and p.stat().st_size <= MAX_FILE_BYTES
            and "site-packages" not in p.parts
        )
        return [Record(p.read_text(errors="replace")) for p in files]
    if source.suffix == ".jsonl":
        records = []
        for number, line in enumerate(source.read_text().splitlines(), 1):
            if line.strip():
                records.append(_record(json.loads(line), tokenizer, f"{source}:{number}"))
        return records
    return [Record(source.read_text(errors="replace"))]


def _record(row: dict, tokenizer: Any, where: str) -> Record:
    answer = row.get("completion", row.get("response"))
    if "messages" in row:
        prompt = tokenizer.apply_chat_template(
            row["messages"], tokenize=False, add_generation_prompt=True
        )
        return Record(prompt, answer, is_prompt=True)
    if "prompt" in row:
        return Record(row["prompt"], answer, is_prompt=True)
    if "text" in row:
        return Record(row["text"])
    raise ValueError(f"{where}: a record needs `text`, `prompt` or `messages`")


def document_tokens(record: Record, tokenizer: Any) -> list[int]:
    """A record's tokens: the text, then the answer (written by now); traffic's own."""
    if record.tokens is not None:
        return list(record.tokens)
    tokens = tokenizer.encode(record.text)
    if record.answer:
        tokens += tokenizer.encode(record.answer, add_special_tokens=False)
    return tokens


ANSWERED_SHARE = 0.5  # of training chunks drawn from answered prompts, when both kinds


class Chunks:
    """The corpus as chunks of `length` tokens: `held_out` (fixed) and `training(seed)`
    (an endless seeded sequence, pass after pass). Tokens are held as one int32 array
    per kind (4 bytes a token: the standard library's ~10M tokens are ~40 MB).

    Documents and what the model writes when asked (answered prompts, traffic) are two
    pools: a few hundred answers beside millions
    of tokens of documents would otherwise almost never be drawn, so when both are given
    `ANSWERED_SHARE` of the training chunks come from the answers (each pool shuffled
    pass after pass, the pick between them seeded too)."""

    def __init__(
        self,
        records: list[Record],
        tokenizer: Any,
        length: int,
        holdout: int,
        max_tokens: int = 1 << 25,
    ) -> None:
        eos = list(tokenizer.eos_token_ids)[:1] or [0]
        answers = [r for r in records if r.is_served]
        documents = [r for r in records if not r.is_served]
        kinds = [kind for kind in (documents, answers) if kind]
        held_each = max(1, holdout // len(kinds)) if kinds else holdout
        self.length = length
        self.tokens = 0
        self._pools, held_out = [], []
        for kind in kinds:
            stream = _stream(kind, tokenizer, eos, max_tokens)
            self.tokens += len(stream)
            count = len(stream) // length
            if count < 2:
                raise ValueError(
                    f"the corpus has {len(stream)} tokens of "
                    f"{'answers' if kind is answers else 'documents'}: fewer than two "
                    f"chunks of {length}"
                )
            chunks = stream[: count * length].reshape(count, length)
            held = np.zeros(count, dtype=bool)
            held[np.arange(0, count, HOLDOUT_EVERY)[: max(1, min(held_each, count - 1))]] = True
            held_out.append(chunks[held])
            self._pools.append(chunks[~held])
        if not kinds:
            raise ValueError("the corpus is empty")
        self.held_out = np.concatenate(held_out)
        self.train = np.concatenate(self._pools)

    def training(self, seed: int) -> Iterator[np.ndarray]:
        if len(self._pools) == 1:
            yield from _shuffled(self._pools[0], seed)
            return
        documents, answers = _shuffled(self._pools[0], seed), _shuffled(self._pools[1], -1 - seed)
        pick = random.Random(f"{seed}:answered")
        while True:
            yield next(answers) if pick.random() < ANSWERED_SHARE else next(documents)

    def frequent_tokens(self, keep: int, always: set[int], vocab: int) -> list[int]:
        """The `keep` ids seen most often in the training chunks (ties: the lower id),
        with `always` (the end-of-sequence ids) among them, then ids never seen (the
        lowest first) while fewer than `keep`; sorted."""
        counts = np.bincount(self.train.reshape(-1), minlength=vocab)
        ranked = np.argsort(-counts, kind="stable").tolist()  # most often first, ties by id
        chosen = {t for t in always if t >= 0}
        for token in ranked:
            if len(chosen) >= keep:
                break
            chosen.add(token)
        return sorted(chosen)


def _stream(records: list[Record], tokenizer: Any, eos: list[int], max_tokens: int) -> np.ndarray:
    """The records' tokens, each followed by EOS, up to about `max_tokens`."""
    parts, total = [], 0
    for record in records:
        tokens = document_tokens(record, tokenizer) + eos
        parts.append(np.asarray(tokens, dtype=np.int32))
        total += len(tokens)
        if total >= max_tokens:
            break
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def _shuffled(chunks: np.ndarray, seed: int) -> Iterator[np.ndarray]:
    """`chunks` in a seeded order, pass after pass (the answers' pool: seed -1 - seed)."""
    passes = 0
    while True:
        order = list(range(len(chunks)))
        random.Random(f"{seed}:{passes}").shuffle(order)
        for index in order:
            yield chunks[index]
        passes += 1
