"""Grammar-constrained decoding: JSON output that matches a schema, via llguidance.

A constraint is one more logits processor: it masks every token the grammar forbids
at this position. Because it is a pure function of the token history (prompt +
generated + any drafts), the speculative engine applies it identically to the
target's verify rows and the draft model's proposals, and a request keeps its
constraint when it migrates between engines: exactness and migration need nothing
special. The matcher follows the history incrementally (roll back to the common
prefix, consume the rest), so verifying k drafts costs k token steps, not a replay.

Building a matcher compiles the grammar (up to a few hundred ms for a big schema), so
it happens once, when the request is prepared in its worker thread; the engine thread
only copies that matcher (microseconds) for each request. A matcher that breaks
mid-output (a failed rollback, an llguidance error state) fails its own request.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np

from engines.errors import InvalidRequest
from engines.request import Constraint

log = logging.getLogger(__name__)

# json.dumps' layout, and no other whitespace: a flexible-whitespace grammar lets a
# model pad or loop on blanks until max_tokens, leaving the JSON unfinished.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Grammars longer than this are refused. llguidance builds a matcher in time that grows
# with the grammar (0.3 s for the 150k characters of a 2,000-branch anyOf), and at about
# 8,400 such branches it runs out of symbol ids and fails.
MAX_GRAMMAR_CHARS = 256_000


class GrammarCompiler:
    """JSON schemas -> grammars, checked against one tokenizer, and per-request
    processors. The llguidance tokenizer is built once, on first use (about a second
    for a 150k vocabulary); any thread may call this."""

    def __init__(self, tokenizer: Any, max_grammar_chars: int = MAX_GRAMMAR_CHARS) -> None:
        self._tokenizer = tokenizer
        self.max_grammar_chars = max_grammar_chars
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    def warm_in_background(self) -> None:
        """Build the llguidance tokenizer off the request path, so the first structured
        request does not stall the event loop for it; a failure shows up then, as a 400."""

        def build() -> None:
            try:
                self.ll_tokenizer  # noqa: B018 - built and cached on first access
            except Exception:  # noqa: BLE001 - reported to the request that needs it
                log.info("constrained decoding unavailable for this tokenizer", exc_info=True)

        threading.Thread(target=build, name="tandem-grammar-warmup", daemon=True).start()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    hf, eos_token=sorted(self._tokenizer.eos_token_ids)
                )
            return self._ll_tokenizer

    def json_schema(self, schema: Any, free_until: int | None = None) -> Constraint:
        """A constraint for JSON matching `schema` (a dict; {} allows any JSON value)."""
        if not isinstance(schema, dict):
            raise InvalidRequest("the JSON schema must be an object")
        with rejected_as_invalid():
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
        return self._compiled(grammar, free_until)

    def _compiled(self, grammar: str, free_until: int | None) -> Constraint:
        """`grammar` with its matcher, built here (the request's worker thread); an
        InvalidRequest if it is too large or llguidance cannot build it."""
        if len(grammar) > self.max_grammar_chars:
            raise InvalidRequest(
                f"the JSON schema is too large to enforce: its grammar has {len(grammar):,} "
                f"characters, at most {self.max_grammar_chars:,}"
            )
        try:
            tokenizer = self.ll_tokenizer
        except Exception as exc:  # noqa: BLE001 - e.g. a slow (non-`tokenizers`) tokenizer
            raise InvalidRequest(
                f"constrained output is not available for this model's tokenizer: {exc}"
            ) from None
        return Constraint(grammar, free_until, new_matcher(tokenizer, grammar))

    def tool_call(
        self, functions: list[dict], start: str, end: str | None, free_until: int | None = None
    ) -> Constraint:
        """Exactly one tool call in the JSON-in-tags format (`<tool_call>` {"name": ...,
        "arguments": {...}} `</tool_call>`), to one of `functions` (chat-template
        function dicts: name, parameters), its arguments matching that tool's schema."""
        rules = [f'start: {self._literal(start)} "\\n" call{self._closing(end)}']
        return self._lark([*rules, f"call: %json {self._calls_schema(functions)}"], free_until)

    def bare_tool_call(self, functions: list[dict], free_until: int | None = None) -> Constraint:
        """Exactly one call as a bare JSON object, {"name": ..., "arguments": {...}}, to
        one of `functions`: for templates without tool-call markup, the shape the
        server reads back as a call (server/untagged_tool_calls.py)."""
        return self._lark([f"start: %json {self._calls_schema(functions)}"], free_until)

    def text_or_tool_calls(
        self, functions: list[dict], start: str, end: str | None, free_until: int | None = None
    ) -> Constraint:
        """Free text with any number of tool calls in it, each in the JSON-in-tags
        format of `tool_call` and valid for its tool. The text never spells the start
        marker, so every call the output parser finds went through the grammar. A
        marker that is a special token triggers the call; one that is plain text ends
        the text as a lazy lexeme (llguidance's recipe for tool calls in free text)."""
        call = f'"\\n" %json {self._calls_schema(functions)}{self._closing(end)}'
        text = f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{regex_literal(start)}(.|\\n)*/"
        literal = self._literal(start)
        if literal == start:  # a special token
            rules = [f"call: TEXT {literal} {call}"]
        else:
            rules = [f"call_start[lazy]: TEXT {literal}", f"call: call_start {call}"]
        return self._lark(["%llguidance {}", "start: call* TEXT", *rules, text], free_until)

    def _calls_schema(self, functions: list[dict]) -> str:
        """One call to one of `functions`, as a JSON schema (json.dumps' layout)."""
        single = len(functions) == 1
        variants = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": function["name"]},
                    "arguments": arguments_schema(
                        function.get("parameters") or {"type": "object"},
                        "/properties/arguments" if single else f"/anyOf/{i}/properties/arguments",
                    ),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for i, function in enumerate(functions)
        ]
        schema = variants[0] if single else {"anyOf": variants}
        return json.dumps({**schema, "x-guidance": JSON_STYLE})

    def _closing(self, end: str | None) -> str:
        return f' "\\n" {self._literal(end)}' if end else ""

    def _lark(self, rules: list[str], free_until: int | None) -> Constraint:
        with rejected_as_invalid():
            grammar = llguidance.LLMatcher.grammar_from_lark("\n".join(rules))
        return self._compiled(grammar, free_until)

    def _literal(self, marker: str) -> str:
        """A marker in lark: a special token by name when it is one, else its text."""
        ids = self._tokenizer.encode(marker, add_special_tokens=False)
        special = set(getattr(self._tokenizer, "all_special_ids", ()) or ())
        added = getattr(getattr(self._tokenizer, "_tokenizer", None), "added_tokens_decoder", {})
        if len(ids) == 1 and (ids[0] in special or ids[0] in added):
            return marker
        return json.dumps(marker)

    def processor(self, constraint: Constraint, prompt_length: int) -> GrammarProcessor:
        """A request's own processor: a copy of the matcher compiled with `constraint`
        (microseconds; a constraint made by hand has none, and builds one here)."""
        matcher = constraint.matcher
        if matcher is None:
            matcher = new_matcher(self.ll_tokenizer, constraint.grammar)
        eos = sorted(self._tokenizer.eos_token_ids)
        vocab = self.ll_tokenizer.vocab_size
        return GrammarProcessor(
            matcher.deep_copy(), vocab, prompt_length, eos, constraint.free_until
        )


SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def arguments_schema(schema: Any, base: str, closable: bool = True) -> Any:
    """A tool's parameters schema as it sits at JSON pointer `base` inside the call's
    schema: local `$ref`s rebased there (pydantic's `#/$defs/...` would otherwise point
    at the call's root), and an object that says nothing of other properties closed to
    the ones it names (`additionalProperties: false`, as vLLM does for guidance): a
    small model otherwise goes on adding keys until max_tokens. Members of `allOf` stay
    open, since closing each part would contradict the others."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = f"#{base}{value[1:]}"
        elif key in SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: arguments_schema(v, base) for k, v in value.items()}
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [arguments_schema(v, base, key != "allOf") for v in value]
        elif key in SUBSCHEMA and isinstance(value, dict):
            out[key] = arguments_schema(value, base)
        else:
            out[key] = value
    if closable and "properties" in out and not {"allOf", "unevaluatedProperties"} & set(out):
        out.setdefault("additionalProperties", False)
    return out


def regex_literal(text: str) -> str:
    """`text` as a regex matching itself, every non-alphanumeric character escaped by
    code point (safe inside lark's /.../)."""
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def new_matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A matcher at the start of `grammar`; InvalidRequest if llguidance cannot build
    one (it reports a bad grammar, an exceeded limit or an internal panic as an error
    state rather than raising)."""
    with rejected_as_invalid():
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequest(f"invalid JSON schema: {summary(matcher.get_error())}")
    return matcher


@contextmanager
def rejected_as_invalid() -> Iterator[None]:
    """llguidance failures as InvalidRequest (a 400): its exceptions, and a Rust panic,
    which pyo3 raises as PanicException, a BaseException (a 500 otherwise)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - whatever llguidance rejects is a bad schema
        raise InvalidRequest(f"invalid JSON schema: {summary(exc)}") from None
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise InvalidRequest(f"invalid JSON schema: {summary(exc)}") from None


def summary(error: object) -> str:
    """llguidance's message without the parser state or backtrace it may append."""
    text = str(error)
    for appendix in ("\n<state>", "\n<backtrace>"):
        text = text.split(appendix, 1)[0]
    return text.strip()


class GrammarProcessor:
    """(tokens, logits) -> logits with forbidden tokens at -inf; one per request."""

    def __init__(
        self,
        matcher: Any,
        vocab_size: int,
        prompt_length: int,
        eos_ids: list[int],
        free_until: int | None,
    ) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.prompt_length = prompt_length
        self.eos_ids = eos_ids
        self.free_until = free_until
        self.consumed: list[int] = []  # what the matcher has consumed, in order
        self.failure: str | None = None  # set if the matcher broke; Sequence.commit raises it
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        generated = tokens.tolist()[self.prompt_length :]
        if self.free_until is not None:
            if self.free_until not in generated:
                return logits  # still reasoning: unconstrained
            generated = generated[generated.index(self.free_until) + 1 :]
        try:
            allowed = self._allowed_after(generated)
        except Exception as exc:  # noqa: BLE001 - fail this request, not the batch's forward
            self.failure = f"constrained decoding failed: {exc}"
            allowed = self._only_eos()
        vocab = logits.shape[-1]
        if allowed.size < vocab:
            allowed = np.concatenate([allowed, np.zeros(vocab - allowed.size, dtype=bool)])
        return mx.where(mx.array(allowed[:vocab]), logits, -mx.inf)

    def _allowed_after(self, generated: list[int]) -> np.ndarray:
        """The tokens the grammar allows after `generated` (a bool per token id)."""
        common = 0
        limit = min(len(self.consumed), len(generated))
        while common < limit and self.consumed[common] == generated[common]:
            common += 1
        if common < len(self.consumed):
            self._roll_back(len(self.consumed) - common)
            del self.consumed[common:]
        new = generated[common:]
        taken = self.matcher.try_consume_tokens(new) if new else 0
        self.consumed.extend(new[:taken])
        self._check()
        if taken < len(new) or self.matcher.is_stopped():
            # Done, or the history left the grammar (only a draft token beyond the
            # first rejected one can: its row is never used). Either way, only EOS.
            return self._only_eos()
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bitmask)
        self._check()
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        allowed = bits[: self.vocab_size].astype(bool)
        if not allowed.any():
            return self._only_eos()
        return allowed

    def _roll_back(self, n: int) -> None:
        if not self.matcher.rollback(n):
            self._check()  # llguidance's own reason, when it gives one
            raise RuntimeError(f"the grammar matcher could not roll back {n} tokens")

    def _check(self) -> None:
        """Raise if the matcher is in llguidance's error state (it never leaves it)."""
        if self.matcher.is_error():
            raise RuntimeError(summary(self.matcher.get_error()))

    def _only_eos(self) -> np.ndarray:
        allowed = np.zeros(max(self.eos_ids) + 1, dtype=bool)
        allowed[self.eos_ids] = True
        return allowed
