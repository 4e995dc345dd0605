"""Prompt scoring between engine steps.

A request asking for its prompt's logprobs (echo + logprobs) is scored a chunk per
scheduler iteration, round robin, after the owning engine's step: a 100k-token
prompt then costs every other stream one chunk's time per token, never one long
freeze. While scored, the request counts as running (it holds a slot); once its
prompt is scored it joins the engine, decoding on from the scored KV cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from typing import Any

from engines.sample.prompt_scoring import PromptScorer


class ScoringQueue:
    """The requests whose prompts are being scored, by request id."""

    def __init__(self) -> None:
        self._jobs: deque[tuple[str, PromptScorer]] = deque()

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, request_id: str, scorer: PromptScorer) -> None:
        self._jobs.append((request_id, scorer))

    def next_job(self, live: Container[str]) -> tuple[str, PromptScorer] | None:
        """The next job with tokens left to score, round robin. Jobs whose request is
        no longer `live` (cancelled, timed out, aborted, failed) are forgotten."""
        self._jobs = deque(job for job in self._jobs if job[0] in live)
        for _ in range(len(self._jobs)):
            job = self._jobs[0]
            self._jobs.rotate(-1)
            if not job[1].done:
                return job
        return None

    def take_done(self, limit: int) -> list[tuple[str, PromptScorer]]:
        """Up to `limit` jobs whose prompts are fully scored, oldest first, removed."""
        done = [job for job in self._jobs if job[1].done][: max(0, limit)]
        self._jobs = deque(job for job in self._jobs if job not in done)
        return done


def scoring_budget(config: Any, others_running: bool) -> int:
    """Tokens to score this iteration: a prefill chunk, the batched engine's (smaller)
    one when other streams are waiting for their next token."""
    return config.batch_prefill_step_size if others_running else config.prefill_step_size
