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
mask, so the language half is exactly an mlx-lm model -- Idefics3 and SmolVLM (Llama),
Gemma-3 (mlx-lm's Gemma-3, windowed layers included; mlx-vlm runs it causally too) --
Qwen2-VL / Qwen2.5-VL / Qwen3-VL (and its MoE), whose 3-D rotary positions ride with
each row's cache (`engines.model.mrope`), Qwen3.5 / Qwen3.6 (mlx-lm's hybrid model
rotating image rows as mlx-vlm does: `engines.model.qwen35_images`), and Gemma-4,
whose image tokens attend both ways (`engines.model.gemma4_images`). Other families
load text-only through mlx-lm and say so.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from engines.model.gemma4_images import gemma4_text_model
from engines.model.mrope import qwen_vl_text
from engines.model.qwen35_images import qwen3_5_text

log = logging.getLogger(__name__)


@dataclass
class ImageSpan:
    """One image in a prompt: its tokens, from its first image token to its last (the
    separators and tile tokens between them included), and the pixel inputs mlx-vlm's
    embedding takes (numpy: made off the engine thread, turned into MLX arrays on it)."""

    ids: list[int]
    inputs: dict[str, np.ndarray]
    # (t, h, w) of its tokens on the image's merged grid, for models that place them
    # there (Qwen-VL's 3-D positions: `engines.model.mrope`); None: at their indices
    grid: tuple[int, int, int] | None = None


@dataclass
class ImageExpansion:
    """What the template's marker for one image becomes in the prompt text, as
    mlx-vlm's processor expands it, with how many image tokens that holds."""

    text: str
    image_tokens: int
    inputs: dict[str, np.ndarray]
    grid: tuple[int, int, int] | None = None  # as `ImageSpan.grid`


class _Recording:
    """A tower layer that keeps its (lazy) output: what `TowerStages` evaluates one at
    a time. Only stands in the encoder's list while `VisionParts.stage` builds the
    graph; the model's own layer computes."""

    def __init__(self, layer: Any, recorded: list) -> None:
        self.layer, self.recorded = layer, recorded

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.layer(*args, **kwargs)
        self.recorded.append(output[0] if isinstance(output, tuple) else output)
        return output


class TowerStages:
    """A prompt's image embeddings, evaluated in steps: each vision tower layer's
    output in turn, then the embeddings (the projector and the merge). The same graph
    evaluated whole gives the same bits; in steps, the batch's other rows decode
    between them, as they do between a long text prompt's chunks. Owned by the engine
    thread, held by the request's `Sequence`."""

    def __init__(self, pending: list, result: list[mx.array]) -> None:
        self.pending = pending
        self.result = result

    @property
    def ready(self) -> bool:
        return not self.pending

    def advance(self) -> None:
        mx.eval(self.pending.pop(0))


class VisionParts:
    """What a loaded vision-language model adds to its language half.

    `expand` runs on a server worker thread (the processor: PIL and numpy only);
    `stage` and `embed_text` run on the engine thread (the vision tower)."""

    def __init__(self, model_type: str, vlm: Any, processor: Any) -> None:
        self.model_type = model_type
        self.vlm = vlm  # mlx-vlm's whole model; its language half shares our weights
        self.processor = processor
        # what a chat template writes per image: Gemma-3's begin-of-image token, else
        # the image token itself (Idefics3's <image>, Gemma-4's)
        boi = None if model_type in EXPANDS_IMAGE_TOKEN else getattr(processor, "boi_token", None)
        self.marker = boi or processor.image_token
        config = vlm.config
        self.image_token_id = int(
            getattr(config, "image_token_index", None) or config.image_token_id
        )
        # the tower's encoder and its list of layers, which `stage` records, if found
        self.encoder, self.encoder_list = tower_encoder(vlm)
        # Qwen-VL's 3-D positions: image tokens sit on the grid merged by this factor
        self.merge = getattr(config.vision_config, "spatial_merge_size", 1)
        self.mrope = model_type in MROPE_MODELS
        # Gemma-4's image tokens attend both ways: a chunk never ends inside an image
        text = getattr(config, "text_config", None)
        self.bidirectional = getattr(text, "use_bidirectional_attention", None) == "vision"
        # pixels one tower batch encodes (--max-tower-pixels); set once at start-up
        self.tower_pixels = TOWER_PIXELS
        # Qwen3-VL's deepstack: tower features also added after the first layers
        self.deepstack = len(getattr(config.vision_config, "deepstack_visual_indexes", ()) or ())

    def expand(self, image: Any) -> ImageExpansion:
        """The marker's expansion for one PIL image, and its pixel inputs."""
        out = self.processor(text=[self.marker], images=[image])
        ids = [int(i) for i in np.array(out["input_ids"])[0]]
        tokenizer = self.processor.tokenizer
        if ids and ids[0] == getattr(tokenizer, "bos_token_id", None):
            ids = ids[1:]  # the prompt around it has its own
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        keep = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
        inputs = {k: np.array(v) for k, v in out.items() if k not in keep and v is not None}
        grid = None
        if self.mrope:
            t, h, w = (int(n) for n in inputs["image_grid_thw"].reshape(-1))
            grid = (t, h // self.merge, w // self.merge)
        return ImageExpansion(text, ids.count(self.image_token_id), inputs, grid)

    def embed_text(self, ids: list[int]) -> mx.array:
        """Text tokens' input embeddings (n, hidden), as mlx-vlm makes them; with
        deepstack, (1 + layers, n, hidden), text adding nothing to those layers."""
        tokens = mx.array(ids, dtype=mx.int32)[None]
        embeds = self.vlm.get_input_embeddings(tokens, None).inputs_embeds[0]
        if not self.deepstack:
            return embeds
        extra = mx.zeros((self.deepstack, *embeds.shape), embeds.dtype)
        return mx.concatenate([embeds[None], extra])

    def tower_batch(self, spans: list[ImageSpan]) -> int:
        """How many of `spans` (at least one) go through the tower together: as many
        as fit `tower_pixels`, counted as the pixel values the tower reads over three
        channels. A prompt whose images fit is encoded as mlx-vlm encodes it (one
        batch: the same bits); beyond that, in batches, so one step of the tower --
        the longest step a new image adds to the batch's others -- stays bounded."""
        total = 0
        for count, span in enumerate(spans):
            total += span.inputs["pixel_values"].size // 3
            if total > self.tower_pixels and count:
                return count
        return len(spans)

    def stage(self, spans: list[ImageSpan]) -> TowerStages:
        """Each span's input embeddings (n, hidden) -- its text tokens' own embeddings
        with the vision tower's features in the image tokens' rows -- as a lazy graph,
        computed a tower layer at a time (`TowerStages.advance`). A prompt's images go
        through the tower together, as mlx-vlm's processor batches them: a GEMM's
        rounding depends on its batch, and greedy output on the last bit."""
        encoder, name, recorded = self.encoder, self.encoder_list, []
        if encoder is not None:
            original = list(getattr(encoder, name))
            setattr(encoder, name, [_Recording(layer, recorded) for layer in original])
        try:
            result = self._embed_lazily(spans)
        finally:
            if encoder is not None:
                setattr(encoder, name, original)
        return TowerStages([*recorded, result], result)

    def _embed_lazily(self, spans: list[ImageSpan]) -> list[mx.array]:
        axis = IMAGE_AXIS.get(self.model_type, 0)
        ids = mx.array([i for span in spans for i in span.ids], dtype=mx.int32)[None]
        inputs = {
            name: _joined([span.inputs[name] for span in spans], axis) for name in spans[0].inputs
        }
        pixels = inputs.pop("pixel_values")
        if self.deepstack:
            embeds = self._deepstack_lazily(ids, pixels, inputs["image_grid_thw"])
        else:
            mask = mx.ones(ids.shape, dtype=mx.int32)  # Gemma-3's asks for one; all attend
            embedded = self.vlm.get_input_embeddings(ids, pixels, mask=mask, **inputs)
            embeds = embedded.inputs_embeds[0]
        ends = list(accumulate(len(span.ids) for span in spans))
        return [
            embeds[..., end - len(span.ids) : end, :] for span, end in zip(spans, ends, strict=True)
        ]

    def _deepstack_lazily(self, ids: mx.array, pixels: mx.array, grid: mx.array) -> mx.array:
        """Qwen3-VL's embeddings with their deepstack features, as its
        `get_input_embeddings` makes them -- the same tower call and mlx-vlm's own
        `masked_scatter` -- but left lazy: that method evaluates the deepstack features
        itself, which would run the whole tower in one step."""
        tower = self.vlm.vision_tower
        features, deep = tower(pixels.astype(tower.patch_embed.proj.weight.dtype), grid)
        text = self.vlm.language_model.model.embed_tokens(ids)
        images = mx.broadcast_to((ids == self.image_token_id)[..., None], text.shape)
        module = sys.modules[type(self.vlm).__module__]  # mlx-vlm's Qwen3-VL module
        embeds = module.masked_scatter(text, images, features)[0]
        return self._with_deepstack(embeds, ids[0], deep)

    def _with_deepstack(self, embeds: mx.array, ids: mx.array, deep: Any) -> mx.array:
        """(1 + layers, n, hidden): the embeddings, then per deepstack layer what is
        added to its output -- the tower's features in the image tokens' rows, zero
        elsewhere (adding zero leaves a text row's state as it was, bit for bit)."""
        deep = mx.stack(list(deep)) if isinstance(deep, list | tuple) else deep
        visual = mx.array(np.flatnonzero(np.array(ids) == self.image_token_id), dtype=mx.uint32)
        dense = mx.zeros((self.deepstack, *embeds.shape), embeds.dtype)
        dense[:, visual] = deep.astype(embeds.dtype)
        return mx.concatenate([embeds[None], dense])


def _joined(arrays: list[np.ndarray], axis: int) -> Any:
    """The images' inputs as mlx-vlm's processor hands a batch of them over: one array,
    or a list where their sizes differ (Gemma-4 keeps each image's aspect)."""
    if len({a.shape[:axis] + a.shape[axis + 1 :] for a in arrays}) > 1:
        return [mx.array(a) for a in arrays]
    return mx.concatenate([mx.array(a) for a in arrays], axis=axis)


def tower_encoder(vlm: Any) -> tuple[Any, str]:
    """The vision tower's encoder (the module holding its list of layers: SigLIP's
    `encoder.layers`, Qwen-VL's `vision_tower.blocks`) and that list's name, or None:
    without it a tower is evaluated whole, in one step."""
    for name, module in vlm.named_modules():
        top = name.split(".")[0]
        if top in ("vision_model", "vision_tower") and name.endswith("encoder"):
            if isinstance(getattr(module, "layers", None), list):
                return module, "layers"
    tower = getattr(vlm, "vision_tower", None)
    if isinstance(getattr(tower, "blocks", None), list):
        return tower, "blocks"
    return None, "layers"


def llama_text(vlm: Any) -> tuple[nn.Module, list]:
    """Idefics3's and SmolVLM's language half as mlx-lm's Llama."""
    from mlx_lm.models import llama

    args = llama.ModelArgs.from_dict({**vars(vlm.config.text_config), "model_type": "llama"})
    args.tie_word_embeddings = False  # mlx-vlm's model keeps its own lm_head
    weights = [
        (name if name.startswith("lm_head") else f"model.{name}", value)
        for name, value in tree_flatten(vlm.language_model.parameters())
    ]
    return llama.Model(args), weights


def gemma3_text(vlm: Any) -> tuple[nn.Module, list]:
    """Gemma-3's language half as mlx-lm's Gemma-3 (causal, as mlx-vlm runs it)."""
    from mlx_lm.models import gemma3

    text = vars(vlm.config.text_config)
    text = {**text, "rope_theta": text.get("rope_global_base_freq", 1_000_000.0)}
    args = gemma3.ModelArgs(model_type="gemma3", text_config=text, vocab_size=text["vocab_size"])
    weights = [
        (f"language_model.{name}", value)
        for name, value in tree_flatten(vlm.language_model.parameters())
    ]
    return gemma3.Model(args), weights


# pixels (values over 3 channels) one vision tower batch reads, by default: SmolVLM's
# largest image (17 tiles of 512x512) alone, or a few of Qwen-VL's 1024x1024 images
TOWER_PIXELS = 4 << 20

# model_type -> the axis of its processor's pixel inputs that counts images (Idefics3's
# are (1, images and tiles, ...), Gemma-3's (images, ...))
IMAGE_AXIS = {"idefics3": 1, "smolvlm": 1}

# model_type -> its language half as an mlx-lm model over mlx-vlm's weights, or (3-D
# positions) mlx-vlm's own layers behind mlx-lm's interface
TEXT_MODELS = {
    "idefics3": llama_text,
    "smolvlm": llama_text,
    "gemma3": gemma3_text,
    "qwen2_vl": qwen_vl_text,
    "qwen2_5_vl": qwen_vl_text,
    "qwen3_vl": qwen_vl_text,
    "qwen3_vl_moe": qwen_vl_text,
    "gemma4": gemma4_text_model,
    "qwen3_5": qwen3_5_text,
    "qwen3_5_moe": qwen3_5_text,
}
# families whose processor expands the image token itself (not a begin-of-image one)
EXPANDS_IMAGE_TOKEN = ("gemma4",)
MROPE_MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
SUPPORTED = tuple(TEXT_MODELS)


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
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.utils import load_model as load_vlm
    from mlx_vlm.utils import load_processor

    path = Path(folder)
    vlm = load_vlm(path)
    processor = load_processor(path, add_detokenizer=False)
    model, weights = TEXT_MODELS[config["model_type"]](vlm)
    if weights and (quantization := config.get("quantization")):
        names = {name for name, _ in weights}
        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda prefix, _: (
                f"{prefix}.scales" in names and quantization.get(prefix, True)
            ),  # a layer's own settings where mlx-vlm kept them (Qwen3.5-MoE's gates)
        )
    if weights:
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
