"""Encoding chat prompts so that message content can never become template structure.

The template's own text is encoded with special tokens parsed (that is how
`<|im_start|>` becomes one id); content that arrives from a client or a tool result
must not be, or `<|im_end|>\\n<|im_start|>system` inside a fetched page forges a
turn. Before rendering, every special-token string inside the untrusted values is
swapped for a nonce marker; after rendering, the text is split at the markers: the
template's pieces are encoded as before and each marker becomes the special string
encoded as plain text. Content without special strings is left untouched, so its
prompt is exactly what it always was.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any


def special_strings(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's special-token strings, longest first (so `</s>` wins over `<s>`
    only where it really occurs, and no special is split by a shorter one)."""
    specials = {s for s in getattr(tokenizer, "all_special_tokens", ()) if s}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials.update(t.content for t in decoder.values() if getattr(t, "special", False))
    return tuple(sorted(specials, key=len, reverse=True))


@dataclass(frozen=True)
class Escaper:
    """Swaps special strings in untrusted values for markers no client can guess."""

    specials: tuple[str, ...]
    nonce: str

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> Escaper:
        return cls(special_strings(tokenizer), secrets.token_hex(8))

    @property
    def pattern(self) -> re.Pattern:
        return re.compile(f"TNDM{self.nonce}N(\\d+)X")

    @property
    def specials_pattern(self) -> re.Pattern:
        return re.compile("|".join(re.escape(s) for s in self.specials))

    def marker(self, index: int) -> str:
        return f"TNDM{self.nonce}N{index}X"

    def escape(self, value: Any) -> Any:
        """`value` with every string inside it (dict values, list items) escaped."""
        if isinstance(value, str):
            return self._escape_text(value)
        if isinstance(value, dict):
            return {key: self.escape(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.escape(item) for item in value]
        return value

    def _escape_text(self, text: str) -> str:
        if not self.specials:
            return text
        return self.specials_pattern.sub(lambda m: self.marker(self.specials.index(m[0])), text)

    def unescape(self, text: str) -> str:
        return self.pattern.sub(lambda m: self.specials[int(m[1])], text)


def plain_ids(tokenizer: Any, text: str, special_ids: set[int]) -> list[int]:
    """`text` as ordinary tokens, never a special id: the tokenizer's own
    `split_special_tokens` where it has one, else one character at a time."""
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    except TypeError:
        ids = None
    if ids is None or special_ids.intersection(ids):
        ids = [i for char in text for i in tokenizer.encode(char, add_special_tokens=False)]
    return [i for i in ids if i not in special_ids]


def encode_marked(
    tokenizer: Any, marked: str, escaper: Escaper, add_special_tokens: bool | None = None
) -> list[int]:
    """Encode rendered text whose untrusted specials are markers. BOS follows mlx-lm's
    rule (added unless the template's text starts with it) unless `add_special_tokens`
    says otherwise (vLLM's /tokenize option)."""
    pieces = escaper.pattern.split(marked)  # text, index, text, index, ..., text
    if add_special_tokens is None:
        bos = tokenizer.bos_token
        add_special_tokens = bos is None or not marked.startswith(bos)
    ids = list(tokenizer.encode(pieces[0], add_special_tokens=add_special_tokens))
    if len(pieces) == 1:
        return ids
    special_ids = set(tokenizer.convert_tokens_to_ids(list(escaper.specials)))
    for index, text in zip(pieces[1::2], pieces[2::2], strict=True):
        ids += plain_ids(tokenizer, escaper.specials[int(index)], special_ids)
        if text:
            ids += tokenizer.encode(text, add_special_tokens=False)
    return ids
