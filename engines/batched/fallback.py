"""The continuous-batching engine: mlx-lm's `BatchGenerator`, wrapped, not patched.

BatchGenerator owns the batched KV caches, prefill and the decode loop. Around it
this engine keeps the Tandem side of each sequence: EOS, `max_tokens` and text stop
sequences are applied by `Sequence.commit` exactly as in the speculative engine
(BatchGenerator gets no stop tokens of its own), per-request samplers that reuse one
callable per distinct unseeded parameter set (BatchGenerator samples rows that share
a sampler object in one call), and the hand-over of sequences in and out with their
KV caches (`take_over` / `hand_over`), so migration never re-prefills. The operations
are `engines.interface.Engine`'s.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import can_trim_prompt_cache

from engines.cache.rollback import trim_exact
from engines.interface import StepResult, starting_state
from engines.model.registry import ModelRegistry
from engines.request import SamplingParams
from engines.sample.logprobs import token_logprob
from engines.sample.sampling import RandomStream, sampling_logits
from engines.sequence import FinishReason, Sequence, StepOutput
from engines.state import Drafting, SequenceState

Sampler = Callable[[mx.array], mx.array]
log = logging.getLogger(__name__)


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class SamplerPool:
    """One sampler per distinct unseeded set of the parameters a sampler uses
    (temperature, top-p, top-k, min-p), so rows batch together; penalties and bias
    are logits processors, not part of it. A seeded request gets its own sampler
    drawing from its own key chain. The pool keeps the `max_size` most recently
    used: a row holds its sampler itself, so forgetting one costs only batching."""

    def __init__(self, max_size: int = 64) -> None:
        self.max_size = max_size
        self._shared: OrderedDict[SamplingParams, Sampler] = OrderedDict()

    def sampler_for(self, seq: Sequence) -> Sampler:
        params = seq.request.sampling
        if params.greedy:
            return greedy
        key = SamplingParams(params.temperature, params.top_p, params.top_k, params.min_p)
        if params.seed is not None:
            return _seeded_sampler(key, seq)
        sampler = self._shared.pop(key, None) or _make_sampler(key, RandomStream.from_seed(None))
        self._shared[key] = sampler  # most recently used last
        if len(self._shared) > self.max_size:
            self._shared.popitem(last=False)
        return sampler

    def __len__(self) -> int:
        return len(self._shared)


def _make_sampler(params: SamplingParams, rng: RandomStream) -> Sampler:
    def sample(logprobs: mx.array) -> mx.array:
        return mx.random.categorical(sampling_logits(params, logprobs), key=rng.next_key())

    return sample


def _seeded_sampler(params: SamplingParams, seq: Sequence) -> Sampler:
    """A seeded row's sampler: the token at output position n is drawn with
    `rng.key_at(n)`, as the single-stream engine draws it, so a seeded request gives
    the same tokens alone or batched. BatchGenerator calls a row's own sampler once per
    token it samples for the row, in order, from the first one it feeds after `insert`
    (output position `len(seq.generated)` then); a new sampler is made at each insert."""
    position = len(seq.generated)
    rng = seq.rng

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal position
        key, position = rng.key_at(position), position + 1
        return mx.random.categorical(sampling_logits(params, logprobs), key=key)

    return sample


class BatchedEngine:
    """Owned by the engine thread: every field (and the generator) is used there only."""

    name = "batched"

    def __init__(
        self, registry: ModelRegistry, max_batch_size: int = 16, prefill_step_size: int = 512
    ) -> None:
        self.registry = registry
        self.model = registry.model_for(self.name)
        self.generator = BatchGenerator(
            self.model,
            completion_batch_size=max_batch_size,
            prefill_batch_size=min(8, max_batch_size),
            prefill_step_size=prefill_step_size,
        )
        self.samplers = SamplerPool()
        self._seqs: dict[int, Sequence] = {}  # uid -> sequence
        self._uids: dict[str, int] = {}  # request id -> uid
        self._gates: dict[str, dict] = {}  # speculative state parked while batched

    @property
    def batch_size(self) -> int:
        return len(self._seqs)

    @property
    def active_ids(self) -> list[str]:
        return list(self._uids)

    @property
    def has_capacity(self) -> bool:
        return True

    def admit(self, start: Sequence | SequenceState) -> None:
        """A new request starts: from an empty cache, or a cached prefix of its prompt."""
        self.take_over(starting_state(start, self.model))

    def take_over(self, state: SequenceState) -> None:
        """Join the batch with the cache as it is: only uncached tokens are fed."""
        seq = state.seq
        tokens = seq.all_tokens
        remaining = seq.request.max_tokens - len(seq.generated)
        (uid,) = self.generator.insert(
            [tokens[state.cached :]],
            max_tokens=[remaining + 1],  # Sequence.commit finishes it first
            caches=[state.cache],
            all_tokens=[tokens[: state.cached]],
            samplers=[self.samplers.sampler_for(seq)],
            logits_processors=[seq.processors],
            stop_sequences=[StopSequences()],
        )
        self._seqs[uid] = seq
        self._uids[seq.request_id] = uid
        if state.drafting.gates is not None:  # kept for the engine it goes back to
            self._gates[seq.request_id] = state.drafting.gates

    def hand_over(self, request_id: str) -> tuple[SequenceState | None, StepResult]:
        """Leave the batch with the KV cache of every committed token but the last
        (nothing is in flight here: the result is empty); None when not here."""
        if request_id not in self._uids:
            return None, StepResult()
        uid = self._uids.pop(request_id)
        seq = self._seqs.pop(uid)
        cache, cached_tokens = self.generator.remove([uid], return_prompt_caches=True)[uid]
        cached = len(cached_tokens)
        if cached >= len(seq.all_tokens):
            # BatchGenerator already fed the newest token (its successor was sampled
            # ahead and is dropped); trim it so the next engine feeds it again. A cache
            # that cannot roll back raises: such models never migrate (`supports_rollback`).
            trim_exact(cache, cached - len(seq.all_tokens) + 1)
            cached = len(seq.all_tokens) - 1
        drafting = Drafting(gates=self._gates.pop(request_id, None))
        return SequenceState(seq, cache, cached, drafting), StepResult()

    def settle(self) -> StepResult:
        """Nothing to settle: a row leaves mlx-lm's generator with what it committed."""
        return StepResult()

    def cancel(self, request_id: str, keep: bool = False) -> bool:
        """End the request (mlx-lm's generator keeps no cache to hand on: `keep` is moot)."""
        uid = self._uids.pop(request_id, None)
        if uid is None:
            return False
        seq = self._seqs.pop(uid)
        seq.finish_reason = FinishReason.CANCELLED
        self.generator.remove([uid])
        self._gates.pop(request_id, None)
        return True

    def copy_cache(self, request_id: str) -> SequenceState | None:
        """None: mlx-lm's generator hands no row's cache out while it decodes (a request
        of its key arriving meanwhile prefills its own)."""
        return None

    def step(self) -> StepResult:
        """One BatchGenerator step: a prefill chunk for new sequences and/or one token
        for every decoding sequence."""
        _, responses = self.generator.next()
        result = StepResult()
        outputs, released = result.outputs, result.released
        for response in responses:
            seq = self._seqs.get(response.uid)
            if seq is None:
                continue
            try:
                text = seq.commit(response.token)
            except Exception as exc:  # noqa: BLE001 - fail this sequence, keep the batch
                log.exception("request %s failed in the batched engine", seq.request_id)
                seq.finish_reason = FinishReason.ERROR
                outputs.append(
                    StepOutput(seq.request_id, [], "", FinishReason.ERROR, error=str(exc))
                )
                self._forget(response.uid, seq, response.finish_reason is None, released)
                continue
            output = StepOutput(
                seq.request_id, [response.token], text, seq.finish_reason, seq.matched_stop
            )
            if seq.request.logprobs is not None:
                output.logprobs = [
                    token_logprob(response.logprobs, response.token, seq.request.logprobs)
                ]
            outputs.append(output)
            if seq.finished:
                self._forget(response.uid, seq, response.finish_reason is None, released)
        return result

    def _forget(
        self, uid: int, seq: Sequence, still_in_generator: bool, released: list[SequenceState]
    ) -> None:
        """A finished sequence leaves; its cache, cut back to committed tokens, goes to
        `released` for prefix reuse."""
        del self._seqs[uid]
        del self._uids[seq.request_id]
        self._gates.pop(seq.request_id, None)
        if still_in_generator:
            cache, fed = self.generator.remove([uid], return_prompt_caches=True)[uid]
            state = _committed_state(seq, cache, list(fed))
            if state is not None:
                released.append(state)

    def close(self) -> None:
        self.generator.close()


def _committed_state(seq: Sequence, cache: list, fed: list[int]) -> SequenceState | None:
    """A finished sequence's cache cut back to committed tokens, for prefix reuse.

    BatchGenerator feeds each token in the step that returns it, so a token whose
    commit raised is in the cache without being in `seq.all_tokens`; it is trimmed
    off. None when the cache cannot be made to hold exactly a committed prefix."""
    committed = seq.all_tokens
    extra = len(fed) - len(committed)
    if extra > 0:
        if not can_trim_prompt_cache(cache):
            return None
        trim_exact(cache, extra)
        fed = fed[: len(committed)]
    if fed != committed[: len(fed)]:
        return None
    return SequenceState(seq, cache, len(fed))
