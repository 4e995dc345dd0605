"""Turning API prompts into token ids, exactly as mlx-lm would.

A text prompt is encoded with special tokens (so BOS is added when the tokenizer
adds one) unless it already starts with the BOS text; chat messages are rendered
with the tokenizer's chat template and then encoded the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import takewhile
from typing import Any

from scheduler.template_traits import TemplateTraits, probe_template
from server.errors import ApiError, bad_request
from server.safe_encoding import Escaper, encode_marked
from server.tool_prompt import messages_for_template


def encode_text(tokenizer: Any, text: str) -> list[int]:
    bos = tokenizer.bos_token
    add_special_tokens = bos is None or not text.startswith(bos)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    """`ids` below `ModelInfo.vocab_size`, which the scheduler enforces for every prompt:
    refused here first so that the error names the field."""
    bad = [i for i in ids if i >= vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})", param)
    return ids


def completion_prompt_ids(tokenizer: Any, prompt: str | list, vocab_size: int) -> list[int]:
    """A single prompt as ids; batches of prompts are refused (one choice per request)."""
    if isinstance(prompt, str):
        return encode_text(tokenizer, prompt)
    if prompt and all(isinstance(p, int) for p in prompt):
        return check_token_ids(list(prompt), vocab_size, "prompt")
    if len(prompt) == 1:
        return completion_prompt_ids(tokenizer, prompt[0], vocab_size)
    raise bad_request("exactly one prompt per request is supported", "prompt")


FIM_TOKEN_SETS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, DeepSeek-style
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder
    ("<PRE>", "<SUF>", "<MID>"),  # Code Llama
)


def fim_tokens(tokenizer: Any) -> tuple[str, str, str] | None:
    """The model's fill-in-the-middle markers, if its vocabulary has a known set."""
    vocab = tokenizer.get_vocab()
    return next((s for s in FIM_TOKEN_SETS if all(t in vocab for t in s)), None)


def fim_prompt_ids(tokenizer: Any, prefix: str, suffix: str) -> list[int]:
    """Prefix-suffix-middle order: the model writes what goes between the two."""
    markers = fim_tokens(tokenizer)
    if markers is None:
        raise bad_request(
            "suffix needs fill-in-the-middle tokens, which this model's tokenizer lacks",
            "suffix",
        )
    prefix_marker, suffix_marker, middle_marker = markers
    return encode_text(tokenizer, f"{prefix_marker}{prefix}{suffix_marker}{suffix}{middle_marker}")


# Chat content parts this model cannot take in: read as a placeholder, so that an
# agent's session goes on when a tool returns a screenshot (a 400 would fail every
# later turn, since the part stays in the conversation).
MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "file": "file"}


def media_placeholder(kind: str) -> str:
    """What the model reads in place of an image, audio or file it cannot take in."""
    return f"[{kind} omitted: this model reads text only]"


@dataclass
class RenderedChat:
    ids: list[int]
    text: str
    starts_in_reasoning: bool  # the template opened a <think> block for the reply
    marked: str = ""  # `text` with the content's special strings as the escaper's markers
    escaper: Escaper | None = None
    checkpoints: tuple[int, ...] = ()  # where the system prompt ends (see `render_chat`)


def extend_chat(
    tokenizer: Any, rendered: RenderedChat, suffix: str, starts_in_reasoning: bool
) -> RenderedChat:
    """The rendered prompt with untrusted `suffix` (a reply prefill) appended as text."""
    escaper = rendered.escaper or Escaper.for_tokenizer(tokenizer)
    marked = (rendered.marked or rendered.text) + escaper.escape(suffix)
    ids = encode_marked(tokenizer, marked, escaper)
    return RenderedChat(
        ids, rendered.text + suffix, starts_in_reasoning, marked, escaper, rendered.checkpoints
    )


def render_chat(
    tokenizer: Any,
    messages: list[dict],
    tools: list | None = None,
    think_start: str | None = None,
    param: str = "messages",
    checkpoint_system: bool = False,
    generation_prompt: bool = True,
    images: Any = None,
    traits: TemplateTraits | None = None,
) -> RenderedChat:
    """Render normalised messages ({"role", "content", "tool_calls"?, ...}, with tool
    call arguments as objects) through the model's chat template and encode them.
    Special-token strings inside any message or tool value are encoded as text, so
    only the template's own markup becomes special ids (see `server.safe_encoding`).
    With `checkpoint_system`, `checkpoints` holds where the tokens every conversation
    with these system messages and tools shares end, as mlx_lm.server finds it: a
    model whose caches cannot be cut back keeps its cache there for the next one.
    With `images` of a vision model, the template reads typed content parts, an image
    part where each image was (`server.image_prompts`). `traits`: what the template
    renders, as the loader probed it (`ModelInfo.template_traits`); probed now if not
    given (tools and tests)."""
    if not tokenizer.has_chat_template:
        raise ApiError(
            400,
            "this model has no chat template; use /v1/completions with a plain prompt",
            "invalid_request_error",
            param=param,
            code="no_chat_template",
        )
    escaper = Escaper.for_tokenizer(tokenizer)
    traits = traits if traits is not None else probe_template(tokenizer)
    try:
        marked = apply_template(
            tokenizer, traits, escaper, messages, tools, generation_prompt, images
        )
    except Exception as exc:  # noqa: BLE001 - templates raise arbitrary errors on bad input
        folded = fold_late_system_turns(messages)
        if folded == messages:
            raise bad_request(f"the chat template rejected these messages: {exc}", param) from exc
        return render_chat(
            tokenizer,
            folded,
            tools,
            think_start,
            param,
            checkpoint_system,
            generation_prompt,
            images,
            traits,
        )
    text = escaper.unescape(marked)
    starts_in_reasoning = bool(think_start) and text.rstrip().endswith(think_start)
    ids = encode_marked(tokenizer, marked, escaper)
    shared = (
        shared_system_end(tokenizer, traits, messages, tools, escaper, ids, images)
        if checkpoint_system
        else 0
    )
    checkpoints = (shared,) if shared else ()
    return RenderedChat(ids, text, starts_in_reasoning, marked, escaper, checkpoints)


def apply_template(
    tokenizer: Any,
    traits: TemplateTraits,
    escaper: Escaper,
    messages: list[dict],
    tools: list | None,
    generation_prompt: bool = True,
    images: Any = None,
) -> str:
    """The template's text for escaped `messages` and `tools` (markers, not specials).
    What the template would drop (tools, earlier calls) is first written into the
    messages as text (`server.tool_prompt`): never silently lost."""
    messages, tools = messages_for_template(traits, messages, tools)
    parts = images is not None and images.reads_images
    text = tokenizer.apply_chat_template(
        escaper.escape(images.as_parts(messages) if parts else messages),
        tools=escaper.escape(tools) or None,
        add_generation_prompt=generation_prompt,
        tokenize=False,
    )
    return images.expand_text(text) if parts else text


def fold_late_system_turns(messages: list[dict]) -> list[dict]:
    """System turns after the conversation started (Claude Code sends them; many
    templates allow a system turn only first) as text at the start of the next user
    turn, or at the end of the last one when none follows. Leading system turns stay."""
    lead = len(list(takewhile(lambda m: m["role"] in ("system", "developer"), messages)))
    folded, pending = list(messages[:lead]), []
    for message in messages[lead:]:
        if message["role"] in ("system", "developer"):
            pending.append(str(message.get("content") or ""))
        elif pending and message["role"] == "user":
            text = "\n\n".join([*pending, str(message.get("content") or "")])
            folded.append({**message, "content": text})
            pending = []
        else:
            folded.append(message)
    if pending and folded and folded[-1]["role"] == "user":
        last = folded[-1]
        folded[-1] = {**last, "content": "\n\n".join([str(last.get("content") or ""), *pending])}
    elif pending:
        folded.append({"role": "user", "content": "\n\n".join(pending)})
    return folded


def prefix_length(
    tokenizer: Any,
    traits: TemplateTraits,
    escaper: Escaper,
    messages: list[dict],
    tools: list | None,
    ids: list[int],
    images: Any = None,
) -> int:
    """How many of `ids` (a prompt rendered with `escaper`) the template rendered for
    `messages` without a generation prompt starts with: where a conversation that
    begins with `messages` stops sharing the prompt's tokens (0 when the template
    refuses them)."""
    try:
        probe = apply_template(tokenizer, traits, escaper, messages, tools, False, images)
    except Exception:  # noqa: BLE001 - a template may insist on its own turn order
        return 0
    shared = 0
    for a, b in zip(encode_marked(tokenizer, probe, escaper), ids, strict=False):
        if a != b:
            break
        shared += 1
    return shared


def shared_system_end(
    tokenizer: Any,
    traits: TemplateTraits,
    messages: list[dict],
    tools: list | None,
    escaper: Escaper,
    ids: list[int],
    images: Any = None,
) -> int:
    """How many of `ids` any conversation with the same system messages and tools
    starts with: the prompt's common prefix with the template rendered for those and
    an empty user turn (0 when there is nothing to share, or the template refuses)."""
    system = list(takewhile(lambda m: m["role"] in ("system", "developer"), messages))
    if not system and not tools:
        return 0
    empty_turn = [*system, {"role": "user", "content": ""}]
    shared = prefix_length(tokenizer, traits, escaper, empty_turn, tools, ids, images)
    return shared if 0 < shared < len(ids) - 1 else 0
