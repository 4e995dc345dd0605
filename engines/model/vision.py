"""Vision-language models: mlx-vlm's vision half beside an mlx-lm language model.

A checkpoint with a `vision_config` is loaded by mlx-vlm (its model classes, weights
and processor: nothing here re-implements them). The language half then runs as the
mlx-lm model with the same architecture, built over the very same weight arrays (no
copy), so every engine path -- prefill chunks, the batch's ragged caches, speculation,
migration, the prefix cache -- runs it as it runs any text model. Only a prompt
chunk that covers an image differs: it is fed as input embeddings, where mlx-vlm's
own `get_input_embeddings` has put the vision tower's features in the image tokens'
rows (`engines.prompt_images`).

Supported: the families whose language model uses plain 1-D positions and a causal
mask, so the language half is exactly an mlx-lm model -- Idefics3 and SmolVLM
(Llama). Qwen-VL's 3-D rotary positions and Gemma-3's bidirectional image attention
are not yet: such checkpoints load text-only through mlx-lm, as before, and say so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

log = logging.getLogger(__name__)

# model_type -> how the language half's parameter names map onto mlx-lm's model
LLAMA_TEXT = ("idefics3", "smolvlm")
SUPPORTED = LLAMA_TEXT
_TEXT_ARGS = (
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "rms_norm_eps",
    "vocab_size",
    "num_key_value_heads",
    "rope_theta",
    "rope_traditional",
)


@dataclass
class ImageSpan:
    """One image as prompt tokens: the ids its marker expands to (the processor's
    tiles, separators and image tokens) and the pixel inputs mlx-vlm's embedding
    takes (numpy: made off the engine thread, turned into MLX arrays on it)."""

    ids: list[int]
    inputs: dict[str, np.ndarray]


class VisionParts:
    """What a loaded vision-language model adds to its language half.

    `span` runs on a server worker thread (the processor: PIL and numpy only);
    `embed` runs on the engine thread (the vision tower)."""

    def __init__(self, model_type: str, vlm: Any, processor: Any) -> None:
        self.model_type = model_type
        self.vlm = vlm  # mlx-vlm's whole model; its language half shares our weights
        self.processor = processor
        self.marker = processor.image_token  # what a chat template writes per image
        self.marker_id = int(processor.tokenizer.convert_tokens_to_ids(self.marker))
        self.image_token_id = int(vlm.config.image_token_index)

    def span(self, image: Any) -> ImageSpan:
        """The tokens and pixel inputs of one PIL image, as mlx-vlm's processor makes
        them for a prompt holding just its marker."""
        out = self.processor(text=[self.marker], images=[image])
        ids = [int(i) for i in np.array(out["input_ids"])[0]]
        bos = getattr(self.processor.tokenizer, "bos_token_id", None)
        if ids and bos is not None and ids[0] == bos:
            ids = ids[1:]  # the prompt around it has its own
        keep = ("input_ids", "attention_mask")
        inputs = {k: np.array(v) for k, v in out.items() if k not in keep and v is not None}
        return ImageSpan(ids, inputs)

    def embed_text(self, ids: list[int]) -> mx.array:
        """Text tokens' input embeddings (n, hidden), as mlx-vlm makes them."""
        tokens = mx.array(ids, dtype=mx.int32)[None]
        return self.vlm.get_input_embeddings(tokens, None).inputs_embeds[0]

    def embed(self, span: ImageSpan) -> mx.array:
        """The span's input embeddings (n, hidden): its text tokens' own embeddings
        with the vision tower's features in the image tokens' rows."""
        ids = mx.array(span.ids, dtype=mx.int32)[None]
        inputs = {k: mx.array(v) for k, v in span.inputs.items()}
        pixels = inputs.pop("pixel_values")
        features = self.vlm.get_input_embeddings(ids, pixels, **inputs)
        return features.inputs_embeds[0]


def is_vision_config(config: dict) -> bool:
    return isinstance(config.get("vision_config"), dict) and bool(config["vision_config"])


def vision_support(config: dict) -> str | None:
    """Why a vision checkpoint will be served text-only, or None when it is served
    with its images."""
    model_type = config.get("model_type", "")
    if model_type not in SUPPORTED:
        return (
            f"model type {model_type!r} is not yet served with images (supported: "
            f"{', '.join(SUPPORTED)}); its images become a text placeholder"
        )
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        return "mlx-vlm is not installed (pip install 'tandem-serve[vision]')"
    return None


def load_vision_model(folder: str, config: dict) -> tuple[Any, Any, VisionParts]:
    """(language model as mlx-lm's, mlx-lm's tokenizer, `VisionParts`) of a supported
    vision checkpoint in `folder`."""
    from mlx_lm.models import llama
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.utils import load_model as load_vlm
    from mlx_vlm.utils import load_processor

    path = Path(folder)
    vlm = load_vlm(path)
    processor = load_processor(path, add_detokenizer=False)
    text = vlm.config.text_config
    args = {name: getattr(text, name) for name in _TEXT_ARGS}
    model = llama.Model(llama.ModelArgs(model_type="llama", tie_word_embeddings=False, **args))
    weights = [
        (name if name.startswith("lm_head") else f"model.{name}", value)
        for name, value in tree_flatten(vlm.language_model.parameters())
    ]
    if quantization := config.get("quantization"):
        names = {name for name, _ in weights}
        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda prefix, _: f"{prefix}.scales" in names,
        )
    model.load_weights(weights)  # the same arrays: the language half is held once
    model.eval()
    eos = config.get("eos_token_id")
    tokenizer = load_tokenizer(path, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    # where a turn ends (SmolVLM's <end_of_utterance>): mlx-vlm's generate stops there too
    extra = getattr(processor, "additional_eos_token_ids", ()) or ()
    tokenizer.eos_token_ids = {*tokenizer.eos_token_ids, *extra}
    parts = VisionParts(config["model_type"], vlm, processor)
    log.info("vision: %s with its image processor (mlx-vlm)", config["model_type"])
    return model, tokenizer, parts
