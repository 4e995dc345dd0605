"""Build tiny random-weight Llama models with a real tokenizer, fully offline.

`tandem serve --demo-random` and the test suite both need a model that loads through the
same `mlx_lm.load` path real users hit, without a network. This module trains a
byte-level BPE tokenizer on a small built-in corpus (`tokenizers`), saves it as a
Hugging Face fast tokenizer with a chat template, and writes a random-init mlx-lm
Llama as `config.json` + `model.safetensors`. The weights are random: output is
gibberish, but deterministic for a given seed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from engines.model.cache_paths import tandem_cache_root

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
CHAT_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
# Reasoning and tool-call markers as single tokens, as in Qwen3-style models, so
# mlx-lm infers thinking support and the json_tools parser for the demo model.
MARKER_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# Fill-in-the-middle markers (Qwen2.5-Coder style), so /v1/completions `suffix` works.
FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
LAYER_WEIGHT_SCALE = 4.0

# ChatML; tools go in the system turn, assistant tool calls are <tool_call> JSON
# (mlx-lm picks its json_tools parser for a template that renders tool_call.name).
CHAT_TEMPLATE = """{{ bos_token }}
{%- set system = messages[0].content if messages and messages[0].role == 'system' else '' %}
{%- if tools %}<|im_start|>system
{% if system %}{{ system }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% elif system %}<|im_start|>system
{{ system }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

_CORPUS = """\
Once upon a time there was a little robot who loved to read books about the sea.
Every morning the robot walked to the harbour and counted the boats, one by one.
The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y
Speculative decoding drafts several tokens and verifies them with one forward pass.
Continuous batching keeps many requests moving through the model at the same time.
The server streams tokens to the client as soon as they are ready.
Please repeat the following text exactly, then summarise it in one sentence.
import json, os, sys
with open("data.json") as f:
    data = json.load(f)
if __name__ == "__main__":
    main()
A stitch in time saves nine. All that glitters is not gold. Numbers: 0 1 2 3 4 5 6 7 8 9.
Hello, world! How are you today? I am fine, thank you. What is your name?
The weather in the mountains changes quickly; bring a coat, water and a map.
"""


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny random Llama; defaults give a ~100k-parameter model."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 2048
    seed: int = 0


def train_tokenizer(out_dir: Path, vocab_size: int = 512, corpus: list[str] | None = None) -> None:
    """Train a byte-level BPE tokenizer offline and save it with a chat template;
    `corpus` defaults to the built-in lines (tests train one on agents' requests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, *CHAT_SPECIAL_TOKENS, *MARKER_TOKENS, *FIM_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if corpus is None:
        corpus = _CORPUS.splitlines(keepends=True) * 4
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    # Like Llama tokenizers: encoding with special tokens prepends BOS.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=[*CHAT_SPECIAL_TOKENS, *MARKER_TOKENS, *FIM_TOKENS],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def write_random_llama(
    out_dir: Path, vocab_size: int, spec: TinyModelSpec, eos_token_ids: list[int]
) -> None:
    """Write a random-init mlx-lm Llama (float32) as config.json + model.safetensors."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_lm.models import llama

    config = {
        "model_type": "llama",
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eos_token_id": eos_token_ids,
        **{k: v for k, v in asdict(spec).items() if k != "seed"},
    }
    mx.random.seed(spec.seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Default init gives tiny residual updates, so the next token depends on the
    # current one only and greedy output cycles within a few tokens. Scaling the
    # layer weights makes attention matter and output varied (still gibberish).
    model.update(tree_map_with_path(_scale_layer_weight, model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))


def _scale_layer_weight(path: str, value):
    if path.startswith("model.layers") and path.endswith("weight") and "norm" not in path:
        return value * LAYER_WEIGHT_SCALE
    return value


def build_tiny_model(
    out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), vocab_size: int = 512
) -> Path:
    """Build (or reuse, if complete) a tiny model directory loadable by `mlx_lm.load`."""
    out = Path(out_dir)
    marker = out / "tandem_demo.json"
    recipe = {
        "spec": asdict(spec),
        "vocab_size": vocab_size,
        # A changed tokenizer or template must rebuild a cached model, not reuse it.
        "special_tokens": [BOS_TOKEN, EOS_TOKEN, *CHAT_SPECIAL_TOKENS, *MARKER_TOKENS, *FIM_TOKENS],
        "chat_template": CHAT_TEMPLATE,
        "layer_weight_scale": LAYER_WEIGHT_SCALE,
    }
    wanted = json.dumps(recipe, sort_keys=True)
    if marker.exists() and marker.read_text() == wanted:
        return out
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out, vocab_size)
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    # End of a chat turn ends generation too, as in ChatML models.
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in (EOS_TOKEN, "<|im_end|>")]
    write_random_llama(out, len(tokenizer), spec, eos_ids)
    marker.write_text(wanted)
    return out


def default_demo_dir() -> Path:
    """Where `tandem serve --demo-random` keeps its model: the user's cache dir."""
    return tandem_cache_root() / "demo-model"
