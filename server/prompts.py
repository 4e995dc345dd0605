"""Turning API prompts into token ids, exactly as mlx-lm would.

A text prompt is encoded with special tokens (so BOS is added when the tokenizer
adds one) unless it already starts with the BOS text; chat messages are rendered
with the tokenizer's chat template and then encoded the same way.
"""

from __future__ import annotations

from typing import Any

from server.errors import ApiError, bad_request
from server.schemas import ChatMessage, TextPart


def encode_text(tokenizer: Any, text: str) -> list[int]:
    bos = tokenizer.bos_token
    add_special_tokens = bos is None or not text.startswith(bos)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def check_token_ids(tokenizer: Any, ids: list[int], param: str) -> list[int]:
    vocab = len(tokenizer)
    bad = [i for i in ids if i >= vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (size {vocab})", param)
    return ids


def completion_prompt_ids(tokenizer: Any, prompt: str | list) -> list[int]:
    """A single prompt as ids; batches of prompts are refused (one choice per request)."""
    if isinstance(prompt, str):
        return encode_text(tokenizer, prompt)
    if prompt and all(isinstance(p, int) for p in prompt):
        return check_token_ids(tokenizer, list(prompt), "prompt")
    if len(prompt) == 1:
        return completion_prompt_ids(tokenizer, prompt[0])
    raise bad_request("exactly one prompt per request is supported", "prompt")


def message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if not isinstance(part, TextPart):
            raise bad_request(
                f"messages[{index}] has a '{part.type}' content part; this model accepts text only",
                f"messages[{index}].content",
            )
        texts.append(part.text)
    return "".join(texts)


def chat_prompt_ids(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    if not tokenizer.has_chat_template:
        raise ApiError(
            400,
            "this model has no chat template; use /v1/completions with a plain prompt",
            "invalid_request_error",
            param="messages",
            code="no_chat_template",
        )
    rendered = [
        {"role": "system" if m.role == "developer" else m.role, "content": message_text(m, i)}
        for i, m in enumerate(messages)
    ]
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - templates raise arbitrary errors on bad input
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from exc
    return encode_text(tokenizer, text)
