"""The sampling fields every OpenAI-shaped generation request shares (chat, completions,
Responses), and their translation to a `GenerationRequest`.

Pure functions: they take the parsed request and model facts and return engine
terms, so each surface's module stays about wire format only. The fields live here,
not in `server.openai.schemas`, so that the Responses surface and this module need
nothing of the OpenAI chat package (which imports this one).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from server.config import DEFAULT_MAX_TOKENS
from server.errors import bad_request, context_exceeded


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """Fields shared by every OpenAI generation endpoint."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = None
    min_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = None
    seed: StrictInt | None = None
    presence_penalty: Annotated[float, Field(strict=True, ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(strict=True, ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(strict=True, ge=0.01, le=10.0)] | None = None
    logit_bias: dict[str, Annotated[float, Field(strict=True, ge=-100.0, le=100.0)]] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(strict=True, ge=1)] = 1
    user: str | None = None
    ignore_eos: StrictBool = False  # vLLM extension: generate to max_tokens
    # Speculation overrides (honoured once the speculative engine lands).
    enable_pld: StrictBool | None = None
    enable_draft: StrictBool | None = None
    num_draft_tokens: Annotated[int, Field(strict=True, ge=0, le=64)] | None = None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > 16:
        raise bad_request("at most 16 stop sequences are supported", "stop")
    return tuple(s for s in stops if s)


def sampling_params(body: SamplingFields, vocab_size: int) -> SamplingParams:
    bias = ()
    if body.logit_bias:
        try:
            bias = tuple((int(k), float(v)) for k, v in body.logit_bias.items())
        except ValueError as exc:
            raise bad_request("logit_bias keys must be token ids", "logit_bias") from exc
        if any(not 0 <= k < vocab_size for k, _ in bias):
            raise bad_request(f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias")
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        min_p=body.min_p or 0.0,
        seed=body.seed,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty or None,
        frequency_penalty=body.frequency_penalty or None,
        logit_bias=bias,
    )


def effective_max_tokens(
    requested: int | None,
    prompt_len: int,
    context: int | None,
    limits: MaxTokens,
    param: str = "max_tokens",
) -> int:
    """How many tokens a request may generate: what it asked for (`limits.default` when
    it names no limit), cut to the operator's cap (`--max-tokens`, if set) and to the
    room its prompt leaves in the context. Clients ask for what their own upstream allows
    (Claude Code 32000) and expect the reply to stop with a length reason only where the
    model must, as the hosted APIs and vLLM do; only a prompt that leaves no room at all
    is refused. With `limits.strict` (`--strict-max-tokens`) asking beyond the cap or the
    room is a 400. The KV budget may cut it further (the scheduler, at submit)."""
    room = None if context is None else context - prompt_len
    if room is not None and room < 1 and requested != 0:
        raise context_exceeded(prompt_len, context)
    if requested == 0:
        return 0
    cap = limits.cap
    if limits.strict and requested is not None:
        if cap is not None and requested > cap:
            raise bad_request(f"{param} is {requested}, above this server's limit of {cap}", param)
        if room is not None and requested > room:
            raise context_exceeded(prompt_len, context, requested)
    bounds = [requested if requested is not None else limits.default]
    bounds += [b for b in (cap, room) if b is not None]
    return max(min(bounds), 1)


@dataclass(frozen=True)
class MaxTokens:
    """The server's limits on one reply's length (from `ServerConfig`)."""

    cap: int | None = None  # --max-tokens: the operator's cap; None = none
    default: int = DEFAULT_MAX_TOKENS  # --default-max-tokens: for a request naming none
    strict: bool = False  # --strict-max-tokens: refuse beyond the cap or room

    @classmethod
    def of(cls, config: Any) -> MaxTokens:
        return cls(config.max_tokens, config.default_max_tokens, config.strict_max_tokens)


def build_request(
    request_id: str,
    body: SamplingFields,
    prompt_ids: list[int],
    max_tokens: int,
    vocab_size: int,
    surface: str,
    logprobs: int | None = None,
) -> GenerationRequest:
    """An OpenAI-shaped body (completions, chat) -> GenerationRequest."""
    if body.n != 1:
        raise bad_request("n > 1 is not supported; send separate requests", "n")
    return GenerationRequest(
        request_id=request_id,
        prompt_tokens=tuple(prompt_ids),
        max_tokens=max_tokens,
        sampling=sampling_params(body, vocab_size),
        stop=stop_strings(body.stop),
        ignore_eos=body.ignore_eos,
        speculation=speculation_overrides(
            body.enable_pld, body.enable_draft, body.num_draft_tokens
        ),
        surface=surface,
        logprobs=logprobs,
    )


def speculation_overrides(
    enable_pld: bool | None, enable_draft: bool | None, num_draft_tokens: int | None
) -> SpeculationOverrides:
    """The per-request speculation switches every surface accepts."""
    return SpeculationOverrides(
        enable_pld=enable_pld, enable_draft=enable_draft, num_draft_tokens=num_draft_tokens
    )
