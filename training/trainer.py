"""`tandem draft train`'s loop: label a batch with the target, train the drafter on it
with one compiled step, report, checkpoint, stop on time.

All of it runs on the calling thread (MLX's streams are per thread). Settings are
fixed at the start of a run and saved with each checkpoint; a killed run given the
same command resumes from its last checkpoint and ends with the weights an
uninterrupted run would have (`tests/test_draft_train.py` kills one to check).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from tqdm import tqdm

from engines.model.taps import decoder_layers
from training import checkpoint
from training.corpus import Chunks
from training.eagle3_ttt import expected_accepted, step_agreement, ttt_loss
from training.labels import Teacher, aux_layer_ids


@dataclass(frozen=True)
class Settings:
    """What makes two runs the same run (a resume must match them)."""

    model: str
    data: str
    seq_len: int = 256
    batch_size: int = 4
    depth: int = 3  # chain steps unrolled in training (the training-time test)
    learning_rate: float = 5e-4
    warmup: int = 50
    draft_vocab: int = 32768
    seed: int = 0
    holdout: int = 16
    # the text itself: how much of the corpus, and how the target answered its prompts
    max_corpus_tokens: int = 1 << 25
    answer_tokens: int = 256
    answer_temperature: float = 0.0
    prompts: int = 0  # requests made from the standard library, answered by the target
    from_traffic: str = ""  # a server's prefix-cache folder whose traffic is trained on


@dataclass
class Limits:
    """When to stop (whichever comes first); none of these change the result of the
    steps that are run."""

    steps: int | None = None
    time_budget: float | None = None  # seconds
    checkpoint_seconds: float = 300.0
    checkpoint_steps: int | None = None
    eval_every: int = 50


@dataclass
class Report:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    loss: float = float("nan")
    agreement: list[float] = field(default_factory=list)
    expected_accepted: float = 0.0
    size_bytes: int = 0
    stopped_by: str = ""


class Trainer:
    """One run: the target (an mlx-lm model), its config, the corpus, the output folder."""

    def __init__(
        self,
        settings: Settings,
        out: Path,
        target: Any,
        target_config: dict,
        chunks: Chunks,
        eos_ids: set[int],
        saved: dict | None = None,
    ) -> None:
        """`saved`: the progress `resumable` found in `out` (None: a new run)."""
        self.settings, self.out, self.chunks = settings, out, chunks
        layers = len(decoder_layers(target))
        if saved is not None:  # resume: the drafter's own config and vocabulary
            self.config = json.loads((out / "config.json").read_text())
            self.draft_ids = saved["draft_ids"]
        else:
            text = target_config.get("text_config", target_config)
            keep = min(settings.draft_vocab, int(text["vocab_size"]))
            self.draft_ids = chunks.frequent_tokens(keep, eos_ids, int(text["vocab_size"]))
            aux = aux_layer_ids(layers)
            self.config = checkpoint.drafter_config(target_config, aux, len(self.draft_ids))
        aux = tuple(self.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        self.teacher = Teacher(target, aux, self.draft_ids)
        self.model = checkpoint.new_drafter(self.config, layers, self.draft_ids, settings.seed)
        self.model.bind(self.teacher.taps.embed_tokens)  # the target's embedding
        warmup = optim.linear_schedule(
            settings.learning_rate / 100, settings.learning_rate, settings.warmup
        )
        schedule = optim.join_schedules(
            [warmup, lambda _: settings.learning_rate], [settings.warmup]
        )
        self.optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
        self.progress = {"step": 0, "chunks": 0, "tokens": 0, "seconds": 0.0}
        if saved is not None:
            checkpoint.restore(out, self.model, self.optimizer)
            self.progress = {k: saved[k] for k in self.progress}
        self.optimizer.init(self.model.trainable_parameters())
        self._step = self._compiled_step()

    def _compiled_step(self):
        depth = self.settings.depth
        loss_and_grad = nn.value_and_grad(self.model, partial(ttt_loss, depth=depth))
        state = [self.model.state, self.optimizer.state]

        @partial(mx.compile, inputs=state, outputs=state)
        def step(features, tokens, labels, mask):
            loss, grads = loss_and_grad(self.model, features, tokens, labels, mask)
            grads, _ = optim.clip_grad_norm(grads, 1.0)
            self.optimizer.update(self.model, grads)
            return loss

        return step

    def batches(self):
        """Batches of chunks in the run's order, from where the run stands."""
        size = self.settings.batch_size
        order = self.chunks.training(self.settings.seed)
        order = itertools.islice(order, self.progress["chunks"], None)
        while True:
            chunk = list(itertools.islice(order, size))
            yield np.stack(chunk)

    def held_out(self) -> list[float]:
        """Per chain step, the held-out top-1 agreement with the target."""
        totals, count = np.zeros(self.settings.depth), 0
        held = self.chunks.held_out
        for start in range(0, len(held), self.settings.batch_size):
            batch = self.teacher.label(held[start : start + self.settings.batch_size])
            rates = step_agreement(
                self.model, batch.features, batch.tokens, batch.target_top, batch.mask,
                self.settings.depth,
            )  # fmt: skip
            totals += np.array(rates)
            count += 1
        return (totals / max(count, 1)).tolist()

    def run(self, limits: Limits) -> Report:
        report = Report()
        started = time.monotonic()
        last_save = started
        offset = self.progress["seconds"]  # time of the run before a resume
        total = limits.steps
        first_step = self.progress["step"]
        bar = tqdm(total=total, initial=first_step, unit="step", dynamic_ncols=True)
        agreement: list[float] = []
        agreed_at = -1  # the step `agreement` was measured at
        loss = float("nan")
        stopped_by = "steps"  # (the loop also ends by the time budget)
        tokens_per_batch = self.settings.batch_size * (self.settings.seq_len - 2)
        for chunks in self.batches():
            if limits.steps is not None and self.progress["step"] >= limits.steps:
                break
            elapsed = time.monotonic() - started
            steps_run = self.progress["step"] - first_step
            per_step = elapsed / steps_run if steps_run else 0.0
            if limits.time_budget is not None and offset + elapsed + per_step > limits.time_budget:
                stopped_by = "time budget"  # the next step would end past it
                break
            batch = self.teacher.label(chunks)
            loss = self._step(batch.features, batch.tokens, batch.labels, batch.mask)
            mx.eval(loss, self.model.parameters(), self.optimizer.state)
            loss = float(loss.item())
            self.progress["step"] += 1
            self.progress["chunks"] += len(chunks)
            self.progress["tokens"] += tokens_per_batch
            now = time.monotonic()
            self.progress["seconds"] = offset + now - started
            step = self.progress["step"]
            if step % limits.eval_every == 0:
                agreement, agreed_at = self.held_out(), step
            bar.set_postfix_str(self._postfix(loss, agreement, limits), refresh=False)
            bar.update(1)
            due = (limits.checkpoint_steps and step % limits.checkpoint_steps == 0) or (
                now - last_save >= limits.checkpoint_seconds
            )
            if due:
                self.save()
                last_save = now
        bar.close()
        if agreed_at != self.progress["step"]:
            agreement = self.held_out()
        self.save()
        report.steps, report.tokens = self.progress["step"], self.progress["tokens"]
        report.seconds, report.loss = self.progress["seconds"], loss
        report.agreement, report.expected_accepted = agreement, expected_accepted(agreement)
        report.size_bytes = sum(p.stat().st_size for p in self.out.glob("*") if p.is_file())
        report.stopped_by = stopped_by
        return report

    def _postfix(self, loss: float, agreement: list[float], limits: Limits) -> str:
        rate = self.progress["tokens"] / max(self.progress["seconds"], 1e-9)
        parts = [f"loss {loss:.3f}", f"{rate:,.0f} tok/s"]
        if agreement:
            parts.append(f"held-out accepted ~{expected_accepted(agreement):.2f}/draft")
        if limits.time_budget is not None:
            left = max(0.0, limits.time_budget - self.progress["seconds"])
            parts.append(f"left {int(left // 60)}:{int(left % 60):02d}")
        return ", ".join(parts)

    def save(self) -> None:
        progress = {**self.progress, "draft_ids": self.draft_ids}
        checkpoint.save(
            self.out, self.config, self.model, self.optimizer, progress, asdict(self.settings)
        )


def resumable(out: Path, settings: Settings) -> dict | None:
    """The progress of the run in `out` to resume (None: none there); a run with other
    settings is refused, naming them."""
    saved = checkpoint.load_state(out)
    if saved is not None and saved["settings"] != asdict(settings):
        changed = [k for k, v in asdict(settings).items() if saved["settings"].get(k) != v]
        raise SystemExit(
            f"{out} holds a run with other settings ({', '.join(changed)}): give the "
            "same settings to resume it, or another --out"
        )
    return saved
