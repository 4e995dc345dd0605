"""Tiny random-weight Qwen-VL models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and its MoE),
built offline from mlx-vlm's own model classes with Qwen's image processors: for the
tests of 3-D rotary positions and deepstack (`engines.model.mrope`)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_TOKENS += ["<|im_start|>", "<|im_end|>"]
# the two vision towers' settings, one block each
_QWEN_TOWER = {"depth": 1, "num_heads": 2, "patch_size": 14, "spatial_patch_size": 14}
_QWEN_TOWER |= {"spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
QWEN_TOWERS = {
    "qwen2_5_vl": {
        **_QWEN_TOWER,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "window_size": 56,
        "fullatt_block_indexes": [0],
    },
    "qwen2_vl": {**_QWEN_TOWER, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2},
}
# Qwen2.5-VL's template, shortened: turns, and the vision start/pad/end per image part.
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_qwen_vl(
    out: Path,
    tokenizer_dir: Path,
    family: str = "qwen2_5_vl",
    seed: int = 0,
    vision: dict | None = None,
) -> Path:
    """A 2-layer Qwen2 language model with 3-D rotary positions (M-RoPE sections), a
    1-block vision tower of `family` (Qwen2.5-VL's or Qwen2-VL's: 14-pixel patches, 2x2
    merge) with random weights, and Qwen2-VL's image processor between 56x56 and
    112x112 pixels: 4 to 16 image tokens per image, on a grid shaped like the image
    (later text's positions trail its index)."""
    import importlib

    module = importlib.import_module(f"mlx_vlm.models.{family}")
    vocab, ids, eos = _qwen_tokenizer(out, tokenizer_dir)
    config = {
        "model_type": family,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": eos,
        "vision_config": {**QWEN_TOWERS[family], **(vision or {}), "model_type": family},
    }
    (out / "config.json").write_text(json.dumps(config))
    # the tests' 40x50 images become 56x84: a 2x3 grid of image tokens
    processor = _image_processor("Qwen2VLImageProcessor", CLIP_NORM, 14, 56, 112)
    processor["resample"] = 3
    (out / "preprocessor_config.json").write_text(json.dumps(processor))
    processor_class = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen2_vl": "Qwen2VLProcessor"}
    processor_class["qwen3_vl"] = "Qwen3VLProcessor"
    (out / "processor_config.json").write_text(
        json.dumps({"processor_class": processor_class[family]})
    )
    return _save_qwen(out, module, config, seed)


CLIP_NORM = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])


def _image_processor(kind: str, norm: tuple, patch: int, low: int, high: int) -> dict:
    """Qwen-VL's image processor settings: images resized between `low` and `high`
    pixels a side (as areas), cut into `patch`-pixel patches merged 2x2."""
    return {
        "image_processor_type": kind,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "rescale_factor": 1 / 255,
        "image_mean": norm[0],
        "image_std": norm[1],
        "size": {"shortest_edge": low * low, "longest_edge": high * high},
        "min_pixels": low * low,
        "max_pixels": high * high,
        "patch_size": patch,
        "merge_size": 2,
        "temporal_patch_size": 2,
    }


def _qwen_tokenizer(out: Path, tokenizer_dir: Path) -> tuple[int, dict, list[int]]:
    """`tokenizer_dir`'s tokenizer with Qwen's vision and turn tokens and template,
    saved in `out`: (vocabulary size, the added tokens' ids, end-of-reply ids)."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(str(out))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_TOKENS}
    return len(tokenizer), ids, [tokenizer.eos_token_id, ids["<|im_end|>"]]


def _save_qwen(out: Path, module, config: dict, seed: int) -> Path:
    from mlx_vlm.utils import update_module_configs

    mx.random.seed(seed)
    params = dict(config)  # from_dict files the text settings under text_config
    model_config = module.ModelConfig.from_dict(params)
    model_config = update_module_configs(model_config, module, params, ["text", "vision"])
    model = module.Model(model_config)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out


def build_qwen3_vl(
    out: Path,
    tokenizer_dir: Path,
    seed: int = 0,
    moe: bool = False,
    vision: dict | None = None,
) -> Path:
    """A 2-layer Qwen3 language model with interleaved 3-D rotary positions (with
    `moe`, Qwen3-VL-MoE's: 4 experts, 2 a token), and a 2-block Qwen3-VL vision tower
    whose first block's features are also added to the language model's first layer
    (deepstack), random weights, and Qwen3-VL's image processor (16-pixel patches)
    between 64x64 and 128x128 pixels: the tests' 40x50 images are a 2x3 grid of
    image tokens."""

    family = "qwen3_vl_moe" if moe else "qwen3_vl"
    vocab, ids, eos = _qwen_tokenizer(out, tokenizer_dir)
    text = {
        "model_type": f"{family}_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5_000_000.0,
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
    }
    if moe:
        text |= {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1}
        text |= {"mlp_only_layers": [], "moe_intermediate_size": 32}
    vision = {"deepstack_visual_indexes": [0], **(vision or {})}
    return _save_qwen3(out, family, text, vision, ids, eos, seed)


def build_qwen3_5(
    out: Path,
    tokenizer_dir: Path,
    seed: int = 0,
    moe: bool = False,
    vision: dict | None = None,
) -> Path:
    """A 4-layer Qwen3.5 language model -- three gated-delta layers, then one gated
    full-attention layer with interleaved 3-D rotary positions on a quarter of each
    head (with `moe`, Qwen3.5-MoE's: 4 experts, 2 a token, and a shared one) -- and
    Qwen3-VL's 2-block vision tower without deepstack, random weights, and the same
    image processor as `build_qwen3_vl`'s: 40x50 images are a 2x3 grid of tokens."""

    family = "qwen3_5_moe" if moe else "qwen3_5"
    vocab, ids, eos = _qwen_tokenizer(out, tokenizer_dir)
    _as_byte_level(out / "tokenizer.json")
    text = {
        "model_type": f"{family}_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.25,
        },
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
    }
    if moe:
        text |= {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1}
        text |= {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
    vision = {"deepstack_visual_indexes": [], **(vision or {})}
    return _save_qwen3(out, family, text, vision, ids, eos, seed)


def _save_qwen3(
    out: Path, family: str, text: dict, vision: dict, ids: dict, eos: list, seed: int
) -> Path:
    """Save a Qwen3-VL-style model of `family` (its text config `text`, whose
    `vocab_size` is the tokenizer's; `ids` and `eos` as `_qwen_tokenizer` gives them)
    with a 2-block Qwen3-VL tower (changed by `vision`) and Qwen3-VL's image processor:
    16-pixel patches merged 2x2, images between 64x64 and 128x128 pixels."""
    import importlib

    tower = {
        "model_type": family,
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "in_channels": 3,
        **vision,
    }
    config = {
        "model_type": family,
        "text_config": text,
        "vision_config": tower,
        "vocab_size": text["vocab_size"],
        "tie_word_embeddings": False,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": eos,
    }
    (out / "config.json").write_text(json.dumps(config))
    processor = _image_processor("Qwen2VLImageProcessorFast", ([0.5] * 3, [0.5] * 3), 16, 64, 128)
    (out / "preprocessor_config.json").write_text(json.dumps(processor))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    module = importlib.import_module(f"mlx_vlm.models.{family}")
    return _save_qwen(out, module, config, seed)


def _as_byte_level(path: Path) -> None:
    """Rewrite a SentencePiece-style BPE `tokenizer.json` in GPT-2's byte-level
    alphabet, in place: transformers reads a Qwen3.5 checkpoint's tokenizer as its
    byte-level `Qwen3_5Tokenizer` whatever the files say, and that would drop every
    space ("▁") and byte-fallback token ("<0x0A>") of the TinyStories vocabulary;
    its pre-tokenizer and decoder say so too (mlx-lm picks its detokenizer by them)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    tokenizer = json.loads(path.read_text())
    model = tokenizer["model"]

    def spelled(piece: str) -> str:
        return "".join(alphabet[b] for b in piece.replace("\u2581", " ").encode())

    def is_byte(piece: str) -> bool:
        return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")

    vocab = {spelled(p): i for p, i in model["vocab"].items() if not is_byte(p)}
    for piece, index in model["vocab"].items():
        if is_byte(piece):  # a byte no piece spells yet becomes that byte's letter
            letter = alphabet[int(piece[3:5], 16)]
            vocab[piece if letter in vocab else letter] = index
    model["vocab"] = vocab
    model["merges"] = [[spelled(a), spelled(b)] for a, b in model["merges"]]
    model["byte_fallback"] = False
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    tokenizer["normalizer"] = None
    tokenizer["pre_tokenizer"] = {"type": "ByteLevel", **byte_level}
    tokenizer["decoder"] = {"type": "ByteLevel", **byte_level}  # as the stream decodes it
    path.write_text(json.dumps(tokenizer))
