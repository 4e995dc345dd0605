"""Tiny random-weight vision-language models, built offline from mlx-vlm's own model
classes with a real image-processor config: for tests (exactness against mlx-vlm's
`generate`) and `tandem bench vision` (a random model of SmolVLM-256M's shape).

The builder is Idefics3's (SmolVLM's family): a Llama language model, a SigLIP-style
vision tower and the pixel-shuffle connector, with Idefics3's image processor (no
image splitting: one tile per image) over a given tokenizer with the image tokens
added.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
# The shape of SmolVLM's template (content as typed parts, an <image> per image part),
# shortened; it reads string content too.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


TEXT = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


VISION = {
    "model_type": "idefics3_vision",
    "hidden_size": 32,
    "num_attention_heads": 2,
    "patch_size": 8,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "image_size": 32,
}


def build_idefics3(
    out: Path,
    tokenizer_dir: Path,
    seed: int = 0,
    template: str = TEMPLATE,
    text: dict | None = None,
    vision: dict | None = None,
    context: int = 2048,
    eos_tokens: tuple[str, ...] = (),
) -> Path:
    """A 2-layer Llama language model, a 1-layer SigLIP-style vision tower, and the
    connector, with random weights; mlx-vlm loads the folder as it loads SmolVLM.
    `tokenizer_dir`'s tokenizer gains the image tokens; `eos_tokens` end a reply."""
    from mlx_vlm.models import idefics3
    from mlx_vlm.utils import update_module_configs
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out))
    vocab = len(tokenizer)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in eos_tokens] or [tokenizer.eos_token_id]
    config = {
        "model_type": "idefics3",
        "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
        "scale_factor": 2,
        "vocab_size": vocab,
        "eos_token_id": eos,
        "max_position_embeddings": context,
        "text_config": {**TEXT, **(text or {}), "vocab_size": vocab},
        "vision_config": {**VISION, **(vision or {})},
    }
    (out / "config.json").write_text(json.dumps(config))
    side, patch = config["vision_config"]["image_size"], config["vision_config"]["patch_size"]
    image_tokens = (side // patch) ** 2 // config["scale_factor"] ** 2
    processor = {
        "image_processor_type": "Idefics3ImageProcessor",
        "do_image_splitting": False,
        "max_image_size": {"longest_edge": side},
        "size": {"longest_edge": side},
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_pad": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 1,
        "rescale_factor": 1 / 255,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor))
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": "Idefics3Processor", "image_seq_len": image_tokens})
    )
    mx.random.seed(seed)
    model_config = idefics3.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, idefics3, dict(config), ["text", "vision"])
    model = idefics3.Model(model_config)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out
