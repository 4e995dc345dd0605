"""TokenLogprob lists -> the two OpenAI wire shapes (legacy completions, chat)."""

from __future__ import annotations

from typing import Any

from engines.sample.logprobs import TokenLogprob


def token_text(tokenizer: Any, token: int) -> str:
    """The token's text; a token that is only part of a UTF-8 character has none, so it
    is shown by its vocabulary entry (unique, unlike U+FFFD)."""
    text = tokenizer.decode([token])
    if "\ufffd" in text:
        return tokenizer.convert_ids_to_tokens([token])[0]
    return text


def completion_logprobs(
    tokenizer: Any, entries: list[TokenLogprob], text_offset: int
) -> tuple[dict, int]:
    """The legacy `logprobs` object, and the text offset after these tokens."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        text = token_text(tokenizer, entry.token)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top_logprobs.append({token_text(tokenizer, t): lp for t, lp in entry.top} or None)
        offsets.append(text_offset)
        text_offset += len(text)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
    return body, text_offset


def prompt_logprobs(
    tokenizer: Any, prompt: tuple[int, ...], scored: list[TokenLogprob], echo_text: str
) -> tuple[dict, int]:
    """The echoed prompt's `logprobs` object: its first token has no score (null). A
    first token the echoed text does not show (a BOS added by tokenization) takes no
    room in `text_offset`, so offsets index the returned text."""
    if not prompt:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, 0
    first = token_text(tokenizer, prompt[0])
    rest, offset = completion_logprobs(
        tokenizer, scored, len(first) if echo_text.startswith(first) else 0
    )
    head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    return join_logprobs(head, rest), offset


def join_logprobs(first: dict, second: dict) -> dict:
    """Two legacy `logprobs` objects, one after the other."""
    return {key: [*first[key], *second[key]] for key in first}


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob]) -> list[dict]:
    """The `logprobs.content` list of a chat choice."""

    def item(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [
        {**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
        for e in entries
    ]


def merge(events: list) -> list[TokenLogprob]:
    return [entry for event in events for entry in (event.logprobs or [])]
