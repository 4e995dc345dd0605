"""A request's whole engine-side state in one object, as in nano-vllm.

`commit()` is the single place where a generated token becomes part of the output:
it applies EOS, `max_tokens` and text stop sequences, so every engine honours them
identically, token by token, even in the middle of a multi-token speculative run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engines.drafting.draft import Drafter
from engines.request import GenerationRequest
from engines.sample.sampling import RandomStream, make_token_processors
from engines.sample.stopping import StopMatcher
from engines.token_sources import SourcedSpecStats, TokenSources


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop sequence
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # client went away or the server aborted the request
    ERROR = "error"


@dataclass
class StepOutput:
    """What one engine step produced for one sequence."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    matched_stop: str | None = None
    error: str | None = None
    logprobs: list | None = None  # TokenLogprob per token, when the request asked


@dataclass
class Sequence:
    request: GenerationRequest
    eos_token_ids: frozenset[int]
    detokenizer: Any  # mlx-lm StreamingDetokenizer, one per sequence
    rng: RandomStream
    stop: StopMatcher = field(init=False)
    generated: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str | None = None
    spec: SourcedSpecStats = field(default_factory=SourcedSpecStats)  # tags token sources
    inject_fault: bool = False  # test hook (--inject-fault-on): commit raises mid-generation
    fault_at: str | None = None  # test hook: the batched engine's point to fail at (faults.py)
    processors: list = field(default_factory=list)  # logits processors: (tokens, logits) -> logits
    # its API key's recent requests, read-only (engines.drafting.suffix.SuffixReader; the
    # scheduler sets it at admission, only ever to the request's own key's): None = none
    suffix: Drafter | None = None
    # Prefill followers (scheduler/prefill_followers.py): `prefilled` is how many tokens its
    # cache holds, as the engine last fed its prompt (a waiting request of its key
    # watches it); `keep_at`, filled by the scheduler, holds prompt positions where the
    # engine stops a prefill chunk and copies the cache out for the prefix cache, for
    # the requests of its key that wait for them.
    prefilled: int = 0
    keep_at: set[int] = field(default_factory=set)
    # each prompt image's input embeddings once the vision tower ran (engine thread;
    # `engines.prompt_images`), dropped when the prompt is in
    image_embeddings: dict[int, Any] = field(default_factory=dict)
    # (the image index it starts at, its `TowerStages`): images whose vision tower runs
    # a layer per batched step, before the chunk that needs them (engine thread)
    image_stage: tuple[int, Any] | None = None

    def __post_init__(self) -> None:
        self.stop = StopMatcher(self.request.stop)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_tokens(self) -> list[int]:
        return [*self.request.prompt_tokens, *self.generated]

    def prefill_stop(self, held: int, end: int) -> int:
        """Where a prefill chunk from `held` stops before `end`: at the nearest position
        to keep (`keep_at`)."""
        return min((p for p in self.keep_at if held < p < end), default=end)

    @property
    def sources(self) -> TokenSources:
        """How each committed token was produced (see engines.token_sources)."""
        return self.spec.sources

    def commit(self, token: int) -> str:
        """Append one generated token; return the text it releases to the client."""
        text = self._append(token)
        self.spec.sources.add(text)
        return text

    def _append(self, token: int) -> str:
        assert not self.finished, "commit after finish"
        if self.inject_fault and len(self.generated) >= 3:
            raise RuntimeError(f"injected fault in request {self.request_id}")
        for processor in self.processors:
            # A processor that broke (see GrammarProcessor) fails only its request,
            # here, rather than raising inside a forward that serves a whole batch.
            failure = getattr(processor, "failure", None)
            if failure:
                raise RuntimeError(failure)
        self.generated.append(token)
        if token in self.eos_token_ids and not self.request.ignore_eos:
            return self._finish(FinishReason.STOP)
        self.detokenizer.add_token(token)
        text, matched = self.stop.feed(self.detokenizer.last_segment)
        if matched is not None:
            self.matched_stop = matched
            self.finish_reason = FinishReason.STOP
            return text
        if len(self.generated) >= self.request.max_tokens:
            return text + self._finish(FinishReason.LENGTH)
        return text

    def _finish(self, reason: FinishReason) -> str:
        """Flush the detokenizer and held-back text; a late stop match still wins."""
        self.detokenizer.finalize()
        text, matched = self.stop.feed(self.detokenizer.last_segment)
        if matched is not None:
            self.matched_stop = matched
            self.finish_reason = FinishReason.STOP
            return text
        self.finish_reason = reason
        return text + self.stop.flush()


def make_sequence(
    request: GenerationRequest, tokenizer: Any, extra_processors: list | None = None
) -> Sequence:
    """Fresh engine-side state for a request: own detokenizer, own RNG, its logits
    processors (penalties and bias, then any extra ones, e.g. constraints)."""
    return Sequence(
        request=request,
        eos_token_ids=frozenset(tokenizer.eos_token_ids),
        detokenizer=tokenizer.detokenizer,
        rng=RandomStream.from_seed(request.sampling.seed),
        processors=[*make_token_processors(request.sampling), *(extra_processors or [])],
    )
