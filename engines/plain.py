"""Plain autoregressive decoding of one sequence: the baseline every engine must match.

The step loop mirrors `mlx_lm.generate_step` (prefill all but the last prompt token
in chunks, then one token per forward, the next forward queued with `async_eval`
before the current token is read), so greedy output is bit-identical to mlx-lm's.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engines.registry import ModelRegistry
from engines.sampling import make_token_processors, sample_token
from engines.sequence import FinishReason, Sequence, StepOutput


class PlainEngine:
    """Serves one sequence at a time. Invariant: after each step the cache holds
    exactly the tokens fed to the model so far (prompt + committed tokens, minus the
    one whose successor is still being computed)."""

    name = "plain"

    def __init__(self, registry: ModelRegistry, prefill_step_size: int = 2048) -> None:
        self.registry = registry
        self.model = registry.target.model
        self.prefill_step_size = prefill_step_size
        self.seq: Sequence | None = None
        self._cache: list | None = None
        self._processors: list = []
        self._history: mx.array | None = None  # tokens seen, for penalty processors
        self._to_prefill: list[int] = []
        self._next: mx.array | None = None  # sampled, not yet committed

    @property
    def has_capacity(self) -> bool:
        return self.seq is None

    @property
    def active_ids(self) -> list[str]:
        return [self.seq.request_id] if self.seq else []

    def add(self, seq: Sequence) -> None:
        assert self.seq is None, "PlainEngine serves one sequence at a time"
        self.seq = seq
        self._cache = make_prompt_cache(self.model)
        self._processors = make_token_processors(seq.request.sampling)
        self._history = None
        self._to_prefill = list(seq.request.prompt_tokens)
        self._next = None

    def cancel(self, request_id: str) -> bool:
        if self.seq is None or self.seq.request_id != request_id:
            return False
        self.seq.finish_reason = FinishReason.CANCELLED
        self._release()
        return True

    def step(self) -> list[StepOutput]:
        """Run one prefill chunk or one decode token for the active sequence."""
        seq = self.seq
        if seq is None:
            return []
        if len(self._to_prefill) > 1:
            self._prefill_chunk()
            return []
        if self._next is None:
            self._next = self._forward_and_sample(mx.array(self._to_prefill))
            self._to_prefill = []
        current = self._next
        if len(seq.generated) + 1 < seq.request.max_tokens:
            self._next = self._forward_and_sample(current)
            mx.async_eval(self._next)
        token = current.item()
        text = seq.commit(token)
        output = StepOutput(seq.request_id, [token], text, seq.finish_reason, seq.matched_stop)
        if seq.finished:
            self._release()
        elif len(seq.generated) % 256 == 0:
            mx.clear_cache()
        return [output]

    def _prefill_chunk(self) -> None:
        n = min(self.prefill_step_size, len(self._to_prefill) - 1)
        chunk = mx.array(self._to_prefill[:n])
        self.registry.check_owner(self.name)
        self.model(chunk[None], cache=self._cache)
        mx.eval([c.state for c in self._cache])
        if self._processors:
            self._history = chunk if self._history is None else mx.concat([self._history, chunk])
        self._to_prefill = self._to_prefill[n:]
        mx.clear_cache()

    def _forward_and_sample(self, tokens: mx.array) -> mx.array:
        self.registry.check_owner(self.name)
        logits = self.model(tokens[None], cache=self._cache)[:, -1, :]
        if self._processors:
            history = self._history
            self._history = tokens if history is None else mx.concat([history, tokens])
            for processor in self._processors:
                logits = processor(self._history, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return sample_token(self.seq.request.sampling, logprobs, self.seq.rng)

    def _release(self) -> None:
        self.seq = None
        self._cache = None
        self._history = None
        self._next = None
        self._to_prefill = []
