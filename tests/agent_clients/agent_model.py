"""A tiny random model fit for coding agents' prompts: long context, and a tokenizer
trained on what those agents really send.

Why not the suite's usual tiny model: its 512-token vocabulary, trained on a few lines,
turns Claude Code's first request into ~52k tokens, and its context is 2048. Trained
on the recorded requests (tests/data/agent_requests/) with a larger vocabulary, the
same prompts are a few times shorter, so a CPU prefills them in seconds, and the
context (131072) holds a whole session. Chat template and special tokens are the demo
model's (engines/model/demo.py), so tool calls are Qwen-style `<tool_call>` JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

from engines.model.demo import (
    _CORPUS,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    TinyModelSpec,
    train_tokenizer,
    write_random_llama,
)

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "agent_requests"
VOCAB_SIZE = 8192
# One layer, one head: a CPU prefills a 19k-token prompt in seconds (attention dominates).
SPEC = TinyModelSpec(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=1,
    num_key_value_heads=1,
    intermediate_size=64,
    max_position_embeddings=131072,
)


def strings_in(value) -> list[str]:
    """Every string inside a JSON value, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *strings_in(v))]
    if isinstance(value, list):
        return [s for v in value for s in strings_in(v)]
    return []


def training_corpus() -> list[str]:
    """The demo corpus, each recorded body as JSON (tools render as JSON) and the text
    inside it (system prompts, messages)."""
    texts = _CORPUS.splitlines(keepends=True) * 4
    for path in sorted(FIXTURES.glob("*.json")):
        body = json.loads(path.read_text())["body"]
        texts.append(json.dumps(body, ensure_ascii=False))
        texts += strings_in(body)
    return texts


def build_agent_model(out_dir: str | Path) -> Path:
    """Build (or reuse, when already complete) the model directory."""
    out = Path(out_dir)
    marker = out / "agent_model.json"
    recipe = json.dumps(
        {
            "spec": SPEC.__dict__,
            "vocab": VOCAB_SIZE,
            "template": CHAT_TEMPLATE,
            "fixtures": sorted(p.name for p in FIXTURES.glob("*.json")),
        },
        sort_keys=True,
    )
    if marker.exists() and marker.read_text() == recipe:
        return out
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out, VOCAB_SIZE, training_corpus())
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in (EOS_TOKEN, "<|im_end|>")]
    write_random_llama(out, len(tokenizer), SPEC, eos_ids)
    marker.write_text(recipe)
    return out


# The demo template, reading content as typed parts too (an <image> per image part):
# a vision model's template is handed parts for every message (server.image_prompts).
_PARTS = (
    "{%- macro text(content) -%}{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for p in content -%}{%- if p.type == 'image' -%}<image>"
    "{%- else -%}{{ p.text }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}\n"
)
VISION_TEMPLATE = _PARTS + CHAT_TEMPLATE.replace("{{ system }}", "{{ text(system) }}").replace(
    "{{ message.content }}", "{{ text(message.content) }}"
)


def build_agent_vision_model(out_dir: str | Path) -> Path:
    """The agent model's tokenizer and size as a tiny Idefics3 vision-language model
    (tests/vlm_models.py), for a coding agent that sends screenshots."""
    from tests.vlm_models import build_idefics3

    out = Path(out_dir)
    text_dir = build_agent_model(out / "text")
    size = {
        "hidden_size": SPEC.hidden_size,
        "intermediate_size": SPEC.intermediate_size,
        "num_attention_heads": SPEC.num_attention_heads,
        "num_key_value_heads": SPEC.num_key_value_heads,
        "num_hidden_layers": SPEC.num_hidden_layers,
    }
    return build_idefics3(
        out / "vision",
        tokenizer_dir=text_dir,
        template=VISION_TEMPLATE,
        text=size,
        context=SPEC.max_position_embeddings,
        eos_tokens=(EOS_TOKEN, "<|im_end|>"),
    )
