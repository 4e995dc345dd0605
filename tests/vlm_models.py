"""Tiny random vision-language models for tests, built from mlx-vlm's own model
classes with a real image-processor config (Idefics3's, at 32x32 pixels: 4 image
tokens per image) over a TinyStories tokenizer with the image tokens added."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
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


def build_idefics3(
    out: Path,
    seed: int = 0,
    tokenizer_dir: Path = SHARED,
    template: str = TEMPLATE,
    text: dict | None = None,
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
        "vision_config": {
            "model_type": "idefics3_vision",
            "hidden_size": 32,
            "num_attention_heads": 2,
            "patch_size": 8,
            "num_hidden_layers": 1,
            "intermediate_size": 64,
            "image_size": 32,
        },
    }
    (out / "config.json").write_text(json.dumps(config))
    processor = {
        "image_processor_type": "Idefics3ImageProcessor",
        "do_image_splitting": False,
        "max_image_size": {"longest_edge": 32},
        "size": {"longest_edge": 32},
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
        json.dumps({"processor_class": "Idefics3Processor", "image_seq_len": 4})
    )
    mx.random.seed(seed)
    model_config = idefics3.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, idefics3, dict(config), ["text", "vision"])
    model = idefics3.Model(model_config)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def png(seed: int, size: tuple[int, int] = (40, 50)) -> bytes:
    """A noise image (different seeds: different images), as PNG bytes."""
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def build_text_draft(vlm_dir: Path, out: Path, noise: float = 0.02, seed: int = 1) -> Path:
    """A text-only mlx-lm Llama over the same tokenizer, for `--draft-model`: the VLM's
    language half with its weights perturbed, so its drafts are partly accepted."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((vlm_dir / "config.json").read_text())
    text = {**config["text_config"], "model_type": "llama", "tie_word_embeddings": False}
    text["eos_token_id"] = config["eos_token_id"]
    (out / "config.json").write_text(json.dumps(text))
    for name in vlm_dir.iterdir():
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(name, out / name.name)
    weights = mx.load(str(vlm_dir / "model.safetensors"))
    mx.random.seed(seed)
    draft = {}
    for name, value in weights.items():
        if not name.startswith("language_model."):
            continue
        name = name.removeprefix("language_model.")
        name = name if name.startswith("lm_head") else f"model.{name}"
        draft[name] = value + noise * mx.random.normal(value.shape)
    mx.save_safetensors(str(out / "model.safetensors"), draft)
    return out
