"""Tiny random-weight vision-language models, built offline from mlx-vlm's own model
classes with a real image-processor config: for tests (exactness against mlx-vlm's
`generate`) and `tandem bench vision` (a random model of SmolVLM-256M's shape).

The builders: Idefics3's (SmolVLM's family: a Llama language model, a SigLIP-style
vision tower and the pixel-shuffle connector, with Idefics3's image processor, tiles
optional), Gemma-3's and Gemma-4's, each over a given tokenizer with the image tokens
added. Qwen-VL's are in `engines.model.demo_qwen_vl`.
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
    tiles: int = 0,
) -> Path:
    """A 2-layer Llama language model, a 1-layer SigLIP-style vision tower, and the
    connector, with random weights; mlx-vlm loads the folder as it loads SmolVLM.
    `tokenizer_dir`'s tokenizer gains the image tokens; `eos_tokens` end a reply; with
    `tiles`, images are split as SmolVLM splits them (row/column tiles and a global view)."""
    from mlx_vlm.models import idefics3
    from mlx_vlm.utils import update_module_configs
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    grid = [f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)]
    tokenizer.add_special_tokens({"additional_special_tokens": [*IMAGE_TOKENS, *grid]})
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
        # with `tiles`, SmolVLM's way: resized to `tiles` tiles on its longer side, cut
        # into tiles of the tower's size, each its own image tokens, and a global view
        "do_image_splitting": bool(tiles),
        "max_image_size": {"longest_edge": side},
        "size": {"longest_edge": side * max(tiles, 1)},
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


GEMMA_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
# Gemma-3's template, shortened: turns, and a <start_of_image> per image part. Without
# Gemma's leading {{ bos_token }}: mlx-vlm's Gemma-3 processor adds one more to a prompt
# that has it (two BOS), where Tandem, like mlx-lm, keeps one; without it both have one.
GEMMA_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build_gemma3(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A 2-layer Gemma-3 language model (one sliding-window layer, one global), a
    1-layer SigLIP vision tower at 32x32 pixels and the pooling projector (4 image
    tokens per image), with random weights and Gemma-3's image processor."""
    from mlx_vlm.models import gemma3
    from mlx_vlm.utils import update_module_configs
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    added = [*GEMMA_TOKENS.values(), "<start_of_turn>", "<end_of_turn>"]
    tokenizer.add_special_tokens({"additional_special_tokens": added})
    tokenizer.chat_template = GEMMA_TEMPLATE
    tokenizer.save_pretrained(str(out))
    settings = json.loads((out / "tokenizer_config.json").read_text())
    settings["extra_special_tokens"] = GEMMA_TOKENS
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    vocab = len(tokenizer)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA_TOKENS.items()}
    text = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "num_hidden_layers": 2,
        "sliding_window": 4096,  # beyond the tests' prompts: rotation is not what they test
        "sliding_window_pattern": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "mm_tokens_per_image": 4,
        "max_position_embeddings": 2048,
    }
    vision = {**VISION, "model_type": "siglip_vision_model"}
    config = {
        "model_type": "gemma3",
        "hidden_size": 64,
        "vocab_size": vocab,
        "image_token_index": ids["image_token"],
        "boi_token_index": ids["boi_token"],
        "eoi_token_index": ids["eoi_token"],
        "pad_token_id": 0,
        "mm_tokens_per_image": 4,
        "eos_token_id": [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")],
        "max_position_embeddings": 2048,
        "text_config": text,
        "vision_config": vision,
    }
    (out / "config.json").write_text(json.dumps(config))
    processor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "do_resize": True,
        "size": {"height": vision["image_size"], "width": vision["image_size"]},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pan_and_scan": False,
        "resample": 2,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor))
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": "Gemma3Processor", "image_seq_length": 4})
    )
    mx.random.seed(seed)
    model_config = gemma3.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, gemma3, dict(config), ["text", "vision"])
    model = gemma3.Model(model_config)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out


# the released Gemma-4 checkpoints' rotary settings per layer type
GEMMA4_ROPE = {
    "full_attention": {
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
        "rope_type": "proportional",
    },
    "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
}
GEMMA4_TOKENS = {
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "image_token": "<|image_soft|>",
}


def build_gemma4(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A 2-layer Gemma-4 language model (a sliding-window layer and a global one, with
    per-layer inputs, attending both ways inside an image as the released checkpoints
    do), a 1-layer Gemma-4 vision tower with random weights, and Gemma-4's image
    processor at its fewest soft tokens (up to 70 an image)."""
    from mlx_vlm.models import gemma4

    out.mkdir(parents=True, exist_ok=True)
    vocab, ids, eos = _gemma_tokenizer(out, tokenizer_dir, GEMMA4_TOKENS)
    text = {
        "model_type": "gemma4_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "global_head_dim": 32,
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 4096,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 16,
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
        "use_double_wide_mlp": False,
        "use_bidirectional_attention": "vision",
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": GEMMA4_ROPE,
    }
    vision = {
        "model_type": "gemma4_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 16,
        "patch_size": 16,
        "position_embedding_size": 128,
        "pooling_kernel_size": 3,
        "default_output_length": 70,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
    }
    config = {
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": vision,
        "vocab_size": vocab,
        "hidden_size": 64,
        "image_token_id": ids["image_token"],
        "boi_token_id": ids["boi_token"],
        "eoi_token_id": ids["eoi_token"],
        "vision_soft_tokens_per_image": 70,
        "eos_token_id": eos,
        "tie_word_embeddings": True,
    }
    (out / "config.json").write_text(json.dumps(config))
    processor = {  # mlx-vlm's numpy Gemma-4 processor reads these
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": False,
        "patch_size": 16,
        "max_soft_tokens": 70,  # the fewest Gemma-4's processor takes
        "pooling_kernel_size": 3,
    }
    image_processor = {"image_processor_type": "Gemma4ImageProcessor", **processor}
    (out / "preprocessor_config.json").write_text(json.dumps(image_processor))
    settings = {"processor_class": "Gemma4Processor", "image_processor": image_processor}
    (out / "processor_config.json").write_text(json.dumps(settings))
    mx.random.seed(seed)
    params = dict(config)
    model_config = gemma4.ModelConfig.from_dict(params)
    from mlx_vlm.utils import update_module_configs

    model_config = update_module_configs(model_config, gemma4, params, ["text", "vision"])
    model = gemma4.Model(model_config)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out


def _gemma_tokenizer(out: Path, tokenizer_dir: Path, tokens: dict) -> tuple[int, dict, list]:
    """`tokenizer_dir`'s tokenizer with a Gemma image token set and turn tokens, its
    template, and the processor's token names: (vocabulary size, ids, end ids)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    added = [*tokens.values(), "<start_of_turn>", "<end_of_turn>"]
    tokenizer.add_special_tokens({"additional_special_tokens": added})
    marker = tokens["image_token"] if "image_token" in tokens else tokens["boi_token"]
    tokenizer.chat_template = GEMMA_TEMPLATE.replace("<start_of_image>", marker)
    tokenizer.save_pretrained(str(out))
    settings = json.loads((out / "tokenizer_config.json").read_text())
    settings["extra_special_tokens"] = tokens
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in tokens.items()}
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    return len(tokenizer), ids, eos
