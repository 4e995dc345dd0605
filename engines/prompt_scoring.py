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

from engines.logprobs import FLOOR, TokenLogprob

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
        rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        rows = mx.maximum(mx.nan_to_num(rows, nan=FLOOR, neginf=FLOOR, posinf=0.0), FLOOR)
        targets = mx.array(prompt[start + 1 : start + 1 + len(piece)])
        chosen = mx.take_along_axis(rows, targets[:, None], axis=-1)[:, 0]
        if top > 0:
            ids = mx.argpartition(-rows, kth=top - 1, axis=-1)[:, :top]
            values = mx.take_along_axis(rows, ids, axis=-1)
            order = mx.argsort(-values, axis=-1)
            ids = mx.take_along_axis(ids, order, axis=-1)
            values = mx.take_along_axis(values, order, axis=-1)
            mx.eval(chosen, ids, values, [c.state for c in cache])
            alternatives = [
                list(zip(i, v, strict=True))
                for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            ]
        else:
            mx.eval(chosen, [c.state for c in cache])
            alternatives = [[] for _ in piece]
        for token, logprob, top_pairs in zip(
            targets.tolist(), chosen.tolist(), alternatives, strict=True
        ):
            scored.append(TokenLogprob(token, logprob, top_pairs))
    return cache, scored
