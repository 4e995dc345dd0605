"""Tiny random vision-language models for tests (`engines.model.demo_vision`'s
Idefics3, at 32x32 pixels: 4 image tokens per image, over the TinyStories tokenizer),
their images, and a text draft model for them."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from engines.model.demo_qwen_vl import build_qwen3_5 as build_qwen35
from engines.model.demo_qwen_vl import build_qwen3_vl as build_qwen3
from engines.model.demo_qwen_vl import build_qwen_vl
from engines.model.demo_vision import build_gemma3 as build_gemma
from engines.model.demo_vision import build_gemma4 as build_gemma_4
from engines.model.demo_vision import build_idefics3 as build_vlm

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"


def build_idefics3(out: Path, **options) -> Path:
    """The tests' tiny Idefics3, over the TinyStories tokenizer unless told otherwise."""
    return build_vlm(out, options.pop("tokenizer_dir", SHARED), **options)


def build_gemma3(out: Path) -> Path:
    """The tests' tiny Gemma-3 (a sliding-window layer and a global one)."""
    return build_gemma(out, SHARED)


def build_gemma4(out: Path) -> Path:
    """The tests' tiny Gemma-4: per-layer inputs, image tokens attending both ways."""
    return build_gemma_4(out, SHARED)


def build_smolvlm_tiles(out: Path) -> Path:
    """Idefics3 splitting images into 32-pixel tiles (up to 2 a side) and a global
    view, as SmolVLM does: row/column tokens and newlines between tiles."""
    return build_idefics3(out, tiles=2)


def build_qwen2_5_vl(out: Path, vision: dict | None = None) -> Path:
    """The tests' tiny Qwen2.5-VL: 3-D rotary positions, 4-16 image tokens per image
    on a grid shaped like the image (`vision`: tower settings, e.g. its depth)."""
    return build_qwen_vl(out, SHARED, vision=vision)


def build_qwen2_vl(out: Path) -> Path:
    """The tests' tiny Qwen2-VL (its own vision tower; the same language half)."""
    return build_qwen_vl(out, SHARED, family="qwen2_vl")


def build_qwen3_vl(out: Path) -> Path:
    """The tests' tiny Qwen3-VL: interleaved 3-D positions and a deepstack layer."""
    return build_qwen3(out, SHARED)


def build_qwen3_vl_moe(out: Path) -> Path:
    """The same with Qwen3-VL-MoE's experts (the 30B-A3B's family)."""
    return build_qwen3(out, SHARED, moe=True)


def build_qwen3_5(out: Path) -> Path:
    """The tests' tiny Qwen3.5: gated-delta layers, then gated attention rotating
    image tokens at their 3-D positions (seed 4: an image's answer runs long, as the
    migration test needs)."""
    return build_qwen35(out, SHARED, seed=4)


def build_qwen3_5_moe(out: Path) -> Path:
    """The same with Qwen3.5-MoE's experts (Qwen3.6-35B-A3B's family; seed 1 for the
    same reason)."""
    return build_qwen35(out, SHARED, seed=1, moe=True)


def build_qwen3_5_mtp(out: Path, head: str = "copy") -> Path:
    """The tests' tiny Qwen3.5 with the MTP head its checkpoints ship (`mtp.*` weights
    beside the model's, `mtp_num_hidden_layers` in its text config): with "copy", the
    head follows the target's next-token path (`bench.hybrid_mtp.add_mtp_head`), so
    many of its drafts are accepted (6 of 17 alone on an image prompt: its attention
    reads image rows at their indices, the target's at their 3-D positions)."""
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_model

    from bench.hybrid_mtp import add_mtp_head

    build_qwen3_5(out)
    config = json.loads((out / "config.json").read_text())
    model = load_model(out)
    flat = {**config["text_config"], "model_type": config["model_type"]}
    weights = {**dict(tree_flatten(model.parameters())), **add_mtp_head(model, flat, head, 4)}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    return out


FAMILIES = {
    "idefics3": build_idefics3,
    "gemma3": build_gemma3,
    "gemma4": build_gemma4,
    "tiles": build_smolvlm_tiles,
    "qwen2_5_vl": build_qwen2_5_vl,
    "qwen2_vl": build_qwen2_vl,
    "qwen3_vl": build_qwen3_vl,
    "qwen3_vl_moe": build_qwen3_vl_moe,
    "qwen3_5": build_qwen3_5,
    "qwen3_5_moe": build_qwen3_5_moe,
}


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
