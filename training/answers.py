"""Prompts the target answers itself: the drafter then learns the text it will really
be asked to draft (the model's own answers, not someone else's).

Answers are written once per output folder (`OUT/answers.jsonl`, renamed into place
when all are done), so a resumed run trains on the same text.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import batch_generate
from mlx_lm.sample_utils import make_sampler

from training.corpus import Record

ANSWERS = "answers.jsonl"
GROUP = 8  # prompts answered together, one batch (mlx-lm's batch_generate)


def answered(
    records: list[Record],
    model: Any,
    tokenizer: Any,
    out: Path,
    max_tokens: int,
    temperature: float,
    seed: int,
    progress: Any = None,
) -> list[Record]:
    """`records` with every prompt that lacks an answer answered by the target, in
    groups of GROUP (seeded sampling at `temperature`, 0 = greedy; an answer ends at
    EOS or `max_tokens`), read back from `out` when a previous run wrote them."""
    path = out / ANSWERS
    todo = [i for i, r in enumerate(records) if r.is_prompt and r.answer is None]
    if not todo:
        return records
    if path.is_file():
        saved = [json.loads(line) for line in path.read_text().splitlines()]
        if [s["prompt"] for s in saved] == [records[i].text for i in todo]:
            return _with(records, todo, [s["answer"] for s in saved])
    sampler = make_sampler(temp=temperature)
    answers: list[str] = []
    for start in range(0, len(todo), GROUP):
        group = todo[start : start + GROUP]
        mx.random.seed(seed + start)  # each group's draws from the seed and its place
        prompts = [tokenizer.encode(records[i].text) for i in group]
        done = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, sampler=sampler)
        answers += done.texts
        if progress is not None:
            progress(len(answers), len(todo))
    out.mkdir(parents=True, exist_ok=True)
    temporary = out / (ANSWERS + ".tmp")
    lines = [
        json.dumps({"prompt": records[i].text, "answer": a})
        for i, a in zip(todo, answers, strict=True)
    ]
    temporary.write_text("\n".join(lines) + "\n")
    os.replace(temporary, path)
    return _with(records, todo, answers)


def _with(records: list[Record], todo: list[int], answers: list[str]) -> list[Record]:
    records = list(records)
    for index, answer in zip(todo, answers, strict=True):
        records[index] = replace(records[index], answer=answer)
    return records
