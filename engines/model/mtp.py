"""A model's own multi-token-prediction (MTP) head, loaded beside mlx-lm's model.

Qwen3.5 / Qwen3.6 (`qwen3_5`, `qwen3_5_moe`) and Qwen3-Next (`qwen3_next`) are
trained with one extra decoder layer that predicts the token after next. mlx-lm
0.32 drops its `mtp.*` weights at load (`sanitize`), so Tandem reads them itself
from the checkpoint's safetensors and builds the head from mlx-lm's own layer
class (the layer is a full-attention decoder layer of the same model):

    e = pre_fc_norm_embedding(embed(x[i+1]))    h = pre_fc_norm_hidden(h[i])
    g = norm(layer(fc([e, h])))                  logits = lm_head(g)

`h[i]` is the target's final hidden state at position i (after its final norm, as
vLLM feeds it); the entry for pair i sits at position i of the head's own KV cache.
Chained drafting feeds the head's own output `g` back as the next hidden state.
The embedding and LM head are the target's (shared, quantized or not).

Checkpoints converted by mlx-lm have no `mtp.*` weights; `--mtp-weights` points at
the original Hugging Face checkpoint (folder or file) that has them.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

log = logging.getLogger(__name__)

MTP_ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
_PREFIX = "mtp."


class MTPUnavailable(ValueError):
    """The model has no usable MTP head; the message says why and what to do."""


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def mtp_layers_in_config(config: dict) -> int:
    text = text_config(config)
    return int(text.get("mtp_num_hidden_layers") or text.get("num_nextn_predict_layers") or 0)


class TargetParts:
    """The target split where MTP needs it: the backbone's normalised hidden states,
    the LM head, the token embedding. Calling backbone then head is exactly what the
    model's own `__call__` does, so logits are bit-identical to a plain forward."""

    def __init__(self, model: Any) -> None:
        text = getattr(model, "language_model", model)  # qwen3_5 wraps its text model
        self.backbone = text.model
        self.embed_tokens = text.model.embed_tokens
        self.lm_head = None if text.args.tie_word_embeddings else text.lm_head

    def logits(self, hidden: mx.array) -> mx.array:
        if self.lm_head is None:
            return self.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def forward(
        self, tokens: mx.array, cache: list, input_embeddings: mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """(logits, hidden states) of a forward over `tokens` (shape (1, n))."""
        if input_embeddings is None:
            hidden = self.backbone(tokens, cache)
        else:  # a prompt chunk with images (the text models that take embeddings)
            hidden = self.backbone(tokens, cache, input_embeddings)
        return self.logits(hidden), hidden

    @property
    def dtype(self) -> mx.Dtype:
        return self.backbone.norm.weight.dtype


class MTPHead(nn.Module):
    """The MTP module (fc over [embedding, hidden], one decoder layer, final norm)."""

    def __init__(self, layer: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = [layer]
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: KVCache) -> mx.array:
        """Output hidden states for pairs (hidden[i], token[i+1]) already embedded,
        shapes (1, n, D); `cache` holds the earlier pairs (causal over them)."""
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        x = self.layers[0](x, mask=create_attention_mask(x, cache), cache=cache)
        return self.norm(x)

    def make_cache(self) -> list[KVCache]:
        return [KVCache()]


def build_head(config: dict) -> MTPHead:
    """An MTP head with random weights shaped for `config`'s model type."""
    text = text_config(config)
    model_type = config.get("model_type", "")
    if model_type not in MTP_ARCHS:
        raise MTPUnavailable(
            f"model type {model_type!r} has no MTP head Tandem can build "
            f"(supported: {', '.join(MTP_ARCHS)})"
        )
    if model_type == "qwen3_next":
        arch = importlib.import_module("mlx_lm.models.qwen3_next")
        args = arch.ModelArgs.from_dict(text)
        layer_class = arch.Qwen3NextDecoderLayer
    else:
        arch = importlib.import_module("mlx_lm.models.qwen3_5")
        args = arch.TextModelArgs.from_dict(text)
        layer_class = arch.DecoderLayer
    # the index of a full-attention layer: the MTP layer attends over its own cache
    layer = layer_class(args, layer_idx=args.full_attention_interval - 1)
    return MTPHead(layer, args.hidden_size, args.rms_norm_eps)


def load_head(model: Any, config: dict, folder: Path, weights_path: Path | None = None) -> MTPHead:
    """The MTP head for `model`, its weights read from `weights_path` (a safetensors
    file or a folder of them) or else from the model's own folder; raises
    `MTPUnavailable` with what to do when there is none."""
    layers = mtp_layers_in_config(config)
    if layers == 0:
        raise MTPUnavailable("the model's config declares no MTP layers")
    if layers != 1:
        raise MTPUnavailable(f"the config declares {layers} MTP layers; Tandem drafts with one")
    head = build_head(config)
    source = weights_path or folder
    raw, unsanitized = read_mtp_weights(source)
    if not raw:
        raise MTPUnavailable(
            f"no mtp.* weights in {source} (mlx-lm drops them when it converts a model); "
            "pass --mtp-weights with the original Hugging Face checkpoint's folder"
        )
    weights = convert_mtp_weights(raw, offset_norms=unsanitized)
    quantization = config.get("quantization")
    if quantization and any(key.endswith(".scales") for key in weights):
        nn.quantize(
            head,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda path, _: f"{path}.scales" in weights,
        )
    dtype = TargetParts(model).dtype
    weights = {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()
    }
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise MTPUnavailable(f"the mtp.* weights in {source} do not fit the model: {exc}") from exc
    mx.eval(head.parameters())
    head.eval()
    return head


def read_mtp_weights(source: Path) -> tuple[dict[str, mx.array], bool]:
    """Every `mtp.*` tensor under `source` (prefix removed), and whether the files
    are a Hugging Face original (their conv1d weights not yet moved by mlx-lm's
    sanitize), whose RMSNorm weights are stored as offsets from 1."""
    weights: dict[str, mx.array] = {}
    conv_shapes: list[tuple[int, ...]] = []
    for file in _files_with_mtp(source):
        for key, value in mx.load(str(file)).items():
            if _PREFIX in key:
                weights[key[key.index(_PREFIX) + len(_PREFIX) :]] = value
            elif key.endswith("conv1d.weight"):
                conv_shapes.append(value.shape)
    if conv_shapes:
        return weights, any(shape[-1] != 1 for shape in conv_shapes)
    # mtp.* weights alone, no model layers beside them: judge by a norm's values
    norm = weights.get("pre_fc_norm_hidden.weight")
    return weights, norm is not None and float(mx.mean(norm).item()) < 0.5


def _files_with_mtp(source: Path) -> list[Path]:
    """The safetensors to read: shards the index lists `mtp.*` weights in (with one
    that holds a conv1d weight, to tell the layout), and files beside the model that
    the index does not list (a head shipped as its own file)."""
    if source.is_file():
        return [source]
    everything = sorted(source.glob("*.safetensors"))
    index = source / "model.safetensors.index.json"
    if not index.exists():
        return everything
    weight_map = json.loads(index.read_text()).get("weight_map", {})
    listed = [source / name for name in _shards_with_mtp(weight_map)]
    unlisted = [path for path in everything if path.name not in set(weight_map.values())]
    return list(dict.fromkeys([*listed, *unlisted]))


def _shards_with_mtp(weight_map: dict[str, str]) -> list[str]:
    """From an index's weight map: the shards holding `mtp.*` weights and, when there
    are any, one shard with a conv1d weight (which tells the layout); else none."""
    with_mtp = sorted({name for key, name in weight_map.items() if _PREFIX in key})
    conv = sorted({name for key, name in weight_map.items() if key.endswith("conv1d.weight")})
    return list(dict.fromkeys([*with_mtp, *conv[:1]])) if with_mtp else []


def convert_mtp_weights(weights: dict[str, mx.array], offset_norms: bool) -> dict[str, mx.array]:
    """Hugging Face names and layouts to the head's: experts stacked into
    `switch_mlp` (per-expert or fused gate_up tensors), and RMSNorm weights stored as
    offsets (Qwen3-Next's `1 + weight` norms) turned into scales."""
    out = dict(weights)
    layers = {key.split(".")[1] for key in out if key.startswith("layers.")}
    for layer in sorted(layers):
        prefix = f"layers.{layer}.mlp"
        fused = out.pop(f"{prefix}.experts.gate_up_proj", None)
        if fused is not None:
            middle = fused.shape[-2] // 2
            out[f"{prefix}.switch_mlp.gate_proj.weight"] = fused[..., :middle, :]
            out[f"{prefix}.switch_mlp.up_proj.weight"] = fused[..., middle:, :]
            out[f"{prefix}.switch_mlp.down_proj.weight"] = out.pop(f"{prefix}.experts.down_proj")
        experts = sorted(
            int(key.split(".")[4])
            for key in out
            if key.startswith(f"{prefix}.experts.") and key.endswith(".up_proj.weight")
        )
        for name in ("gate_proj", "up_proj", "down_proj"):
            if experts:
                out[f"{prefix}.switch_mlp.{name}.weight"] = mx.stack(
                    [out.pop(f"{prefix}.experts.{e}.{name}.weight") for e in experts]
                )
    if offset_norms:
        for key, value in out.items():
            if key.endswith("norm.weight") and value.ndim == 1:
                out[key] = value + 1.0
    return out


class MTPStepModel:
    """One MTP draft step shaped like a model (`model(tokens, cache)` -> logits,
    `make_cache`), so the start-up cost measurement times it like a draft model."""

    def __init__(self, head: MTPHead, target: TargetParts) -> None:
        self.head = head
        self.target = target

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        embeddings = self.target.embed_tokens(tokens)
        return self.target.logits(self.head(embeddings, embeddings, cache[0]))

    def make_cache(self) -> list[KVCache]:
        return self.head.make_cache()


def weights_source(spec: str) -> Path:
    """`--mtp-weights`: a local file or folder, or a hub id of the original checkpoint,
    of which only the index and the shards holding `mtp.*` (and one conv1d weight, to
    tell the layout) are downloaded."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    if spec.startswith(("/", "./", "../", "~")) or spec.endswith(".safetensors"):
        raise MTPUnavailable(f"--mtp-weights: no file or folder at {spec}")
    from huggingface_hub import hf_hub_download, snapshot_download

    index = Path(hf_hub_download(spec, "model.safetensors.index.json"))
    weight_map = json.loads(index.read_text()).get("weight_map", {})
    wanted = ["model.safetensors.index.json", *_shards_with_mtp(weight_map)]
    return Path(snapshot_download(spec, allow_patterns=wanted))


def local_folder(folder: str) -> Path:
    """The files of what `mlx_lm.load` loaded: a local folder, or a hub id's snapshot
    in the Hugging Face cache (already downloaded by the load)."""
    path = Path(folder).expanduser()
    if path.exists():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(folder, local_files_only=True))
