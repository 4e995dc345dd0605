"""Prompt logprobs (`echo` + `logprobs` on completions, as evaluation harnesses use):
score every prompt token while building the prompt's KV cache, so the request then
decodes from that cache with no second prefill.

Scores are the model's raw log-probabilities (no penalties or bias: those apply to
what the model generates), like vLLM's prompt_logprobs. The first prompt token has
no score: nothing precedes it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engines.logprobs import TokenLogprob, token_logprobs

# Rows of full-vocabulary log-probabilities held at once (256 x 150k floats = 150 MB).
SCORE_CHUNK = 256


def score_prompt(
    model: Any, prompt: list[int], top: int, chunk: int = SCORE_CHUNK
) -> tuple[list[Any], list[TokenLogprob]]:
    """A cache holding prompt[:-1], and the score of each of prompt[1:] (with `top`
    alternatives) given the tokens before it. Call on the engine thread, with the
    model of the engine that owns it."""
    cache = make_prompt_cache(model)
    scored: list[TokenLogprob] = []
    body = prompt[:-1]
    for start in range(0, len(body), chunk):
        piece = body[start : start + chunk]
        logits = model(mx.array(piece)[None], cache=cache)[0].astype(mx.float32)
        mx.eval([c.state for c in cache])
        rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        scored += token_logprobs(rows, prompt[start + 1 : start + 1 + len(piece)], top)
    return cache, scored
