"""vLLM's tokenizer routes: POST /tokenize, POST /detokenize and GET /tokenizer_info.

Evaluation harnesses score loglikelihood tasks on token ids, so they need the served
model's tokenizer. lm-eval's `local-completions` asks the server for it through these
routes (at the root, as vLLM serves them) and otherwise downloads a tokenizer named
after the model: with no network, or a served name that is no hub id, it cannot run.
The ids are the ones generation uses: a text prompt encoded as /v1/completions encodes
it, messages rendered as /v1/chat/completions renders them. Tokenizing and decoding run
in a worker thread (about 1 ms per thousand tokens: long text would pause streams).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr
from starlette.requests import Request
from starlette.responses import JSONResponse

from scheduler.template_traits import TemplateTraits
from server.errors import bad_request
from server.http import check_model, config_of, model_info_of, off_the_loop, parse_body
from server.openai.chat import normalize_messages
from server.openai.schemas import ChatMessage, TokenId, ToolSpec
from server.prompts import (
    check_token_ids,
    encode_text,
    render_chat,
)
from server.safe_encoding import encode_marked

if TYPE_CHECKING:
    from scheduler.loading import ModelInfo


class TokenizeRequest(BaseModel):
    """vLLM's two shapes in one model: `prompt` (completions) or `messages` (chat).
    `add_special_tokens` left out means "as generation would": the tokenizer's special
    tokens unless the text already starts with BOS; given, it is passed to the tokenizer
    as is (vLLM's meaning)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool | None = False
    tools: list[ToolSpec] | None = None
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]


def refuse_unserved(body: TokenizeRequest) -> None:
    """Exactly one prompt form, and nothing the chat endpoint would not render."""
    if body.prompt is None and body.messages is None:
        raise bad_request("prompt (text) or messages (chat) is required", "prompt")
    if body.prompt is not None and body.messages is not None:
        raise bad_request("give prompt (text) or messages (chat), not both", "messages")
    if body.messages is None:
        return
    if body.chat_template is not None:
        raise bad_request(
            "a request's own chat_template is not served: the model's template renders "
            "messages, as on /v1/chat/completions",
            "chat_template",
        )
    if body.chat_template_kwargs:
        raise bad_request(
            "chat_template_kwargs are not served: /v1/chat/completions takes none",
            "chat_template_kwargs",
        )
    if body.continue_final_message:
        raise bad_request(
            "continue_final_message is not served: /v1/chat/completions has no such option",
            "continue_final_message",
        )


def prompt_ids(tokenizer: Any, prompt: str, add_special_tokens: bool | None) -> list[int]:
    if add_special_tokens is None:
        return encode_text(tokenizer, prompt)  # as /v1/completions encodes it
    return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))


def chat_ids(tokenizer: Any, traits: TemplateTraits, body: TokenizeRequest) -> list[int]:
    """The messages through the model's chat template (with the chat endpoint's fallback
    for late system turns). With the generation prompt and no `add_special_tokens`,
    exactly the prompt /v1/chat/completions prefills."""
    messages = normalize_messages(body.messages or [])
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    rendered = render_chat(  # 400 without a template, or when it refuses the messages
        tokenizer, messages, tools, generation_prompt=body.add_generation_prompt, traits=traits
    )
    if body.add_special_tokens is None:
        return rendered.ids
    return encode_marked(tokenizer, rendered.marked, rendered.escaper, body.add_special_tokens)


def tokenized(info: ModelInfo, body: TokenizeRequest) -> JSONResponse:
    """The answer, encoded and serialized (in a worker thread)."""
    tokenizer = info.tokenizer
    if body.messages is not None:
        ids = chat_ids(tokenizer, info.template_traits, body)
    else:
        ids = prompt_ids(tokenizer, body.prompt or "", body.add_special_tokens)
    strings = list(tokenizer.convert_ids_to_tokens(ids)) if body.return_token_strs else None
    return JSONResponse(
        {
            "count": len(ids),
            "max_model_len": info.context_length,
            "tokens": ids,
            "token_strs": strings,
        }
    )


async def tokenize(request: Request) -> JSONResponse:
    """POST /tokenize: vLLM's `{count, max_model_len, tokens, token_strs}`."""
    body = await parse_body(request, TokenizeRequest)
    check_model(config_of(request), body.model)
    refuse_unserved(body)
    info = model_info_of(request)
    return await off_the_loop(tokenized, info, body)


def detokenized(tokenizer: Any, ids: list[int], vocab_size: int) -> JSONResponse:
    check_token_ids(ids, vocab_size, "tokens")
    return JSONResponse({"prompt": tokenizer.decode(ids)})


async def detokenize(request: Request) -> JSONResponse:
    """POST /detokenize: `{tokens}` -> `{prompt}`, special tokens written out (as vLLM)."""
    body = await parse_body(request, DetokenizeRequest)
    check_model(config_of(request), body.model)
    info = model_info_of(request)
    return await off_the_loop(detokenized, info.tokenizer, body.tokens, info.vocab_size)


# --- GET /tokenizer_info ------------------------------------------------------------------

# Where the tokenizer was loaded from and how: nothing a client needs, and a path on this
# disk is never shown (the model list names the served name only). `vocab` and `merges`
# would be the whole vocabulary.
LOADING_KEYS = frozenset(
    {
        "name_or_path",
        "is_local",
        "local_files_only",
        "cache_dir",
        "revision",
        "token",
        "use_auth_token",
        "trust_remote_code",
        "_commit_hash",
        "vocab",
        "merges",
    }
)
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
_LEFT_OUT = object()


def json_value(value: Any) -> Any:
    """`value` as JSON can carry it: an `AddedToken` as its text, dict keys as strings;
    what JSON cannot hold (a non-finite float, an object) is left out."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _LEFT_OUT
    if isinstance(getattr(value, "content", None), str):
        return value.content
    if isinstance(value, dict):
        items = ((str(k), json_value(v)) for k, v in value.items())
        return {k: v for k, v in items if v is not _LEFT_OUT}
    if isinstance(value, list | tuple):
        return [v for v in map(json_value, value) if v is not _LEFT_OUT]
    return _LEFT_OUT


def chat_template_text(tokenizer: Any) -> str | None:
    """The Jinja template the server renders chats with (a named set: its default)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def tokenizer_config(tokenizer: Any) -> dict:
    """What vLLM's /tokenizer_info answers: the tokenizer's own settings (its
    `tokenizer_config.json`, as loaded), `tokenizer_class` and `chat_template`, with
    the special tokens always named (lm-eval reads `eos_token` and `bos_token`)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds the HF one
    init = getattr(hf, "init_kwargs", None) or {}
    config = {
        key: value
        for key, value in json_value(dict(init)).items()
        if key not in LOADING_KEYS and not key.endswith(("_file", "_path"))
    }
    for name in SPECIAL_TOKENS:
        config[name] = json_value(getattr(hf, name, None))
    config["tokenizer_class"] = type(hf).__name__
    config.pop("chat_template", None)
    template = chat_template_text(hf)
    if template is not None:
        config["chat_template"] = template
    return config


async def tokenizer_info(request: Request) -> JSONResponse:
    """GET /tokenizer_info: enough for a client to build the tokenizer without a download."""
    info = model_info_of(request)
    return JSONResponse(await off_the_loop(tokenizer_config, info.tokenizer))
