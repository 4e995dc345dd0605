"""Prompt logprobs (`echo` + `logprobs` on completions, as evaluation harnesses use):
score every prompt token while building the prompt's KV cache, so the request then
decodes from that cache with no second prefill.

Scores are the model's raw log-probabilities (no penalties or bias: those apply to
what the model generates), like vLLM's prompt_logprobs. The first prompt token has
no score: nothing precedes it.

A `PromptScorer` works a bounded number of tokens at a time, so the scheduler can
interleave a long prompt's scoring with other requests' steps.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engines.sample.logprobs import TokenLogprob, token_logprobs

# Rows of full-vocabulary log-probabilities held at once (256 x 150k floats = 150 MB).
SCORE_CHUNK = 256


class PromptScorer:
    """Scores prompt[1:] and fills a cache with prompt[:-1], a few tokens per call.

    Invariant: the cache holds prompt[:cached], and `scored` holds the scores of
    prompt[1 : cached + 1]. Done when cached == len(prompt) - 1: the request decodes
    on from this cache, feeding the last prompt token."""

    def __init__(self, model: Any, prompt: list[int], top: int) -> None:
        self.cache = make_prompt_cache(model)
        self.prompt = prompt
        self.top = top
        self.cached = 0
        self.scored: list[TokenLogprob] = []

    @property
    def done(self) -> bool:
        return self.cached >= len(self.prompt) - 1

    def step(self, model: Any, budget: int, chunk: int = SCORE_CHUNK) -> int:
        """Score up to `budget` more tokens with `model` (the owning engine's; call on
        the engine thread), `chunk` rows at a time; returns how many were scored."""
        end = min(len(self.prompt) - 1, self.cached + max(1, budget))
        start = self.cached
        while self.cached < end:
            piece = self.prompt[self.cached : min(self.cached + chunk, end)]
            logits = model(mx.array(piece)[None], cache=self.cache)[0].astype(mx.float32)
            mx.eval([c.state for c in self.cache])
            rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            following = self.prompt[self.cached + 1 : self.cached + 1 + len(piece)]
            self.scored += token_logprobs(rows, following, self.top)
            self.cached += len(piece)
        return self.cached - start
