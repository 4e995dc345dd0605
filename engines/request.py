"""What a client asks for, in engine terms: token ids and sampling settings.

The server builds these from any API surface; the scheduler and engines never see
JSON. Both dataclasses are frozen so a request can be shared across threads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engines.errors import InvalidRequest

_PREFIX_BLOCK = 1024  # tokens `common_prefix` compares at once (in C) before narrowing


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature == 0 means greedy (argmax)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpeculationOverrides:
    """Per-request switches for the speculative engine; None means server default."""

    enable_pld: bool | None = None
    enable_draft: bool | None = None
    num_draft_tokens: int | None = None


@dataclass(frozen=True)
class Constraint:
    """What the output must match: an llguidance grammar (compiled from a JSON schema
    by `engines.sample.constraints.GrammarCompiler`).

    `free_until`: a token id (a reasoning model's `</think>`) before which output is
    unconstrained, for templates that open a think block; the grammar applies after it.

    `matcher`: llguidance's matcher at the grammar's start, built with the constraint
    (off the engine thread). It is never advanced, only copied: each request's
    processor follows its own copy, so a constraint can be shared.
    """

    grammar: str
    free_until: int | None = None
    matcher: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class PromptImage:
    """An image in the prompt: the positions its tokens take from `start` and what the
    vision tower reads (`span`: an `engines.model.vision.ImageSpan`, made by the server).
    `digest` (a hash of the image's bytes) is part of the request's cache scope, so a
    cached prefix never stands in for a different image at the same positions."""

    start: int
    span: Any = field(compare=False, repr=False)
    digest: str = ""

    @property
    def end(self) -> int:
        return self.start + len(self.span.ids)


@dataclass(frozen=True)
class GenerationRequest:
    """One generation job: prompt token ids, sampling, limits and stop conditions."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    speculation: SpeculationOverrides = field(default_factory=SpeculationOverrides)
    surface: str = ""  # which API asked (for logs and metrics only)
    logprobs: int | None = None  # report each token's logprob and this many alternatives
    constraint: Constraint | None = None  # output must match this grammar
    prompt_logprobs: int | None = None  # score the prompt too, with this many alternatives
    cache_scope: str = ""  # prefix reuse only among requests of one scope (an API key's id)
    # prompt positions to keep a cache at where caches cannot be cut back (the end of a
    # chat's system prompt: what every conversation with it shares)
    checkpoints: tuple[int, ...] = ()
    images: tuple[PromptImage, ...] = ()  # in prompt order; their tokens are in prompt_tokens

    @property
    def prefix_scope(self) -> str:
        """The prefix cache's partition for this prompt: its key's scope, and for a
        prompt with images the digests of its images in order. Image tokens are the
        same ids for every image, so a prefix through an image is only reused for the
        same images (the same screenshot in an agent's next turn)."""
        return image_scope(self.cache_scope, self.images)


def image_scope(cache_scope: str, images: Sequence[PromptImage]) -> str:
    """The prefix cache's partition for prompts of `cache_scope`'s key holding exactly
    `images`, in order (`GenerationRequest.prefix_scope`)."""
    if not images:
        return cache_scope
    digests = "\n".join(image.digest for image in images).encode()
    return f"{cache_scope}\x1fimages:{hashlib.sha256(digests).hexdigest()[:32]}"


def next_checkpoint(request: GenerationRequest, cached: int, end: int) -> int:
    """Where the prefill from `cached` should stop next: the first of the request's
    checkpoints after it, or `end` (the prompt's last position but one)."""
    return min((p for p in request.checkpoints if cached < p < end), default=end)


def at_checkpoint(request: GenerationRequest, cached: int, end: int) -> bool:
    """Whether a cache holding `cached` tokens is one to keep: at the prompt's end or at
    one of its checkpoints."""
    return cached == end or cached in request.checkpoints


def check_token_ids(request: GenerationRequest, limit: int) -> None:
    """Every prompt id and logit-bias id in [0, limit). MLX does not bounds-check an
    index: a larger or negative id would read the embedding (and a penalty or bias
    write the logits) out of bounds and corrupt the process, not fail the request."""
    ids = [*request.prompt_tokens, *(token for token, _ in request.sampling.logit_bias)]
    low, high = min(ids), max(ids)
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise InvalidRequest(
            f"token id {bad} is outside this model's vocabulary (0 to {limit - 1})"
        )


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token sequences share (compared a block at a time,
    so two identical 20k-token prompts take microseconds, not a Python loop each): a
    prompt against a running one, a cache's tokens against a prompt, a draft model's
    fed tokens against its context."""
    a, b = list(a), list(b)
    shared, limit = 0, min(len(a), len(b))
    while shared < limit:
        step = min(_PREFIX_BLOCK, limit - shared)
        if a[shared : shared + step] == b[shared : shared + step]:
            shared += step
            continue
        for x, y in zip(a[shared : shared + step], b[shared : shared + step], strict=True):
            if x != y:
                return shared
            shared += 1
    return shared
