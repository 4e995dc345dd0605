"""Gemma-4's `-assistant` drafter, for a target served by mlx-lm's `gemma4_text`.

Google publishes a small drafter beside each Gemma-4 model (`google/gemma-4-*-assistant`,
`model_type: gemma4_assistant`). It has no KV cache and no K/V projections of its own:
its (four) decoder layers, mlx-lm's own `gemma4_text.DecoderLayer` built as KV-shared
layers, project only queries and attend over the K/V the target already holds, read from
two target layers, the last non-KV-shared full-attention layer and the last non-KV-shared
sliding layer (the arrays in their caches, so after the target's k_norm and RoPE).
One drafting step for a sequence whose target holds T positions:

    x = pre_projection([embed_target(token) * sqrt(H_target), h])
    x = layers(x, query at position T - 1, K/V of the target)   g = norm(x)
    logits = head(g)            h_next = post_projection(g)

`h` is the target's final-norm output at its newest position for the first step, then
the drafter's own `h_next` when chaining; the query position stays T - 1 for every chained
step (the K/V do not grow while drafting). The head is the drafter's own (tied) embedding,
or for the small models a centroid-routed sparse head (`masked_embedding`): only the top-k
clusters' tokens get real logits, every other token `min(real) - 1`.

Written against mlx-vlm 0.7.10's `speculative/drafters/gemma4_assistant` (same weights,
same published key names), with these deliberate differences:
  * Attention masks say which K/V slots a row may read (`kv_lengths` or explicit masks),
    never a guess from the array length: a slot is valid when it is among a row's first
    min(T, S) of S slots, and for sliding layers among the newest `sliding_window` of those
    (the keys at positions > (T - 1) - window). mlx-vlm places the query at slot
    min(T - 1, S) of the array's own frame: right while the array holds every position
    (S = T), one slot off once the target trimmed its sliding cache (S < T): it then drops
    slot 0 of a full rotating buffer (an arbitrary key once it has wrapped), or keeps only
    window - 1 keys of a longer, temporally ordered one (after a multi-token verify).
  * The masked head's filler is per row (no host sync); mlx-vlm uses the batch minimum.
  * The target's embedding is held outside the module tree, so it is never a "parameter"
    of the drafter (mlx-vlm registers it as a child module).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma4_text

FULL, SLIDING = "full_attention", "sliding_attention"
# Per-layer-input gates exist in the Gemma-4 text layer, but the drafter is never given a
# per-layer input, so they would be dead weights if a checkpoint carries them.
_UNUSED_WEIGHTS = ("per_layer_input_gate.", "per_layer_projection.", "post_per_layer_input_norm.")

Lengths = int | mx.array


class DrafterMismatch(ValueError):
    """The assistant cannot read this target's K/V; the message names the field."""


def is_gemma4_assistant_config(config: dict) -> bool:
    """True for a Gemma-4 assistant checkpoint's `config.json`."""
    arches = config.get("architectures") or []
    return config.get("model_type") == "gemma4_assistant" or any(
        "Gemma4Assistant" in a for a in arches
    )


@dataclass(frozen=True)
class Gemma4AssistantConfig:
    """The published config.json: the head's top-level fields, and the decoder's
    `text_config` read with mlx-lm's own argument class (so its defaults are the target's)."""

    text: gemma4_text.ModelArgs
    backbone_hidden_size: int
    tie_word_embeddings: bool = True
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    block_size: int = 4

    @classmethod
    def from_config(cls, config: dict) -> Gemma4AssistantConfig:
        raw = dict(config.get("text_config") or {})
        if raw.get("enable_moe_block"):
            raise ValueError("a Gemma-4 assistant with an MoE block is not supported")
        # Every assistant layer is KV-shared (it has no K/V projections; HF's config reads
        # an unset count as "all"), and it is never given per-layer inputs, so its layers
        # are built without those gates (their weights, if shipped, are dropped at load).
        n = int(raw.get("num_hidden_layers", 4))
        fixed = {
            "num_hidden_layers": n,
            "num_kv_shared_layers": n,
            "hidden_size_per_layer_input": 0,
        }
        text = gemma4_text.ModelArgs.from_dict({**raw, **fixed})
        head = {f.name: config[f.name] for f in dataclasses.fields(cls)[2:] if f.name in config}
        cfg = cls(text, int(config.get("backbone_hidden_size", 1536)), **head)
        if cfg.use_ordered_embeddings and text.vocab_size % cfg.num_centroids:
            raise ValueError(f"vocab {text.vocab_size} is not a multiple of the centroid count")
        return cfg

    def head_dim_for(self, layer_type: str) -> int:
        full = layer_type == FULL and self.text.global_head_dim
        return self.text.global_head_dim if full else self.text.head_dim


def _target_args(target_config: dict) -> gemma4_text.ModelArgs:
    return gemma4_text.ModelArgs.from_dict(target_config.get("text_config", target_config))


def _rope_key(params: Mapping[str, Any]) -> tuple:
    kind = params.get("rope_type", params.get("type", "default"))
    prf = params.get("partial_rotary_factor", 1.0) if kind == "proportional" else 1.0
    return kind, float(params.get("rope_theta", 10000.0)), float(prf), params.get("factor", 1.0)


def _shared_layers(config: Gemma4AssistantConfig, args: gemma4_text.ModelArgs) -> dict[str, int]:
    """The last non-KV-shared target layer of each type the drafter attends with."""
    last: dict[str, int] = {}
    for i, kind in enumerate(
        args.layer_types[: args.num_hidden_layers - args.num_kv_shared_layers]
    ):
        last[kind] = i
    needed = dict.fromkeys(config.text.layer_types)
    missing = [t for t in needed if t not in last]
    if missing:
        raise DrafterMismatch(f"layer_types: the target has no non-shared {missing[0]} layer")
    return {t: last[t] for t in needed}


def check_fits(config: Gemma4AssistantConfig | dict, target_config: dict) -> None:
    """Raise DrafterMismatch unless the assistant can draft for this target: same hidden
    size and vocabulary, query heads shaped like the shared layers' keys, same RoPE."""
    if isinstance(config, dict):
        config = Gemma4AssistantConfig.from_config(config)
    args = _target_args(target_config)

    def fail(field: str, mine: Any, theirs: Any) -> None:
        raise DrafterMismatch(f"{field}: the assistant has {mine!r}, the target {theirs!r}")

    if config.backbone_hidden_size != args.hidden_size:
        fail("hidden_size (backbone_hidden_size)", config.backbone_hidden_size, args.hidden_size)
    if config.text.vocab_size != args.vocab_size:
        fail("vocab_size", config.text.vocab_size, args.vocab_size)
    for kind in _shared_layers(config, args):
        full = kind == FULL and bool(args.global_head_dim)
        theirs = args.global_head_dim if full else args.head_dim
        if config.head_dim_for(kind) != theirs:
            name = "global_head_dim" if full else "head_dim"
            fail(f"{name} ({kind} layers)", config.head_dim_for(kind), theirs)
        k_eq_v = kind == FULL and args.attention_k_eq_v and args.num_global_key_value_heads
        kv_heads = args.num_global_key_value_heads if k_eq_v else args.num_key_value_heads
        if config.text.num_attention_heads % kv_heads:
            fail(
                f"num_attention_heads vs {kind} kv heads", config.text.num_attention_heads, kv_heads
            )
        mine_rope = _rope_key(config.text.rope_parameters.get(kind, {}))
        their_rope = _rope_key(args.rope_parameters.get(kind, {}))
        if mine_rope != their_rope:
            fail(f"rope_parameters[{kind}]", mine_rope, their_rope)


class _Inner(nn.Module):
    def __init__(self, cfg: Gemma4AssistantConfig) -> None:
        super().__init__()
        t = cfg.text
        self.embed_tokens = nn.Embedding(t.vocab_size, t.hidden_size)
        # mlx-lm's own Gemma-4 layer: with no K/V of its own (every layer KV-shared) it
        # projects only queries and attends over the `shared_kv` it is handed.
        self.layers = [gemma4_text.DecoderLayer(t, i) for i in range(t.num_hidden_layers)]
        self.norm = nn.RMSNorm(t.hidden_size, eps=t.rms_norm_eps)


class _MaskedEmbedding(nn.Module):
    """Centroid-routed head: score clusters, take the top-k clusters' tokens
    (`token_ordering` lists each cluster's tokens contiguously), logits for those only."""

    def __init__(self, cfg: Gemma4AssistantConfig) -> None:
        super().__init__()
        self.top_k, self.vocab_size = cfg.centroid_intermediate_top_k, cfg.text.vocab_size
        self.centroids = nn.Linear(cfg.text.hidden_size, cfg.num_centroids, bias=False)
        self.token_ordering = mx.zeros((self.vocab_size,), dtype=mx.int32)

    def __call__(self, h: mx.array, table: mx.array) -> mx.array:
        B, L, _ = h.shape
        scores = self.centroids(h)
        top = mx.argpartition(scores, kth=-self.top_k, axis=-1)[..., -self.top_k :]
        clusters = self.token_ordering.reshape(self.centroids.weight.shape[0], -1)
        ids = clusters[top].reshape(B, L, -1)
        logits = (table[ids] @ h[..., None]).squeeze(-1)
        fill = logits.min(axis=-1, keepdims=True) - 1.0
        out = mx.broadcast_to(fill, (B, L, self.vocab_size))
        return mx.put_along_axis(out, ids, logits, axis=-1)


@dataclass(frozen=True)
class _TargetLink:
    """What `bind` takes from the target; a plain object so MLX does not adopt it."""

    embed: nn.Module
    scale: float
    layers: dict[str, int]


class Gemma4AssistantModel(nn.Module):
    """The drafter. `bind(target)` once, then `step` per drafted token (see module doc)."""

    def __init__(self, config: Gemma4AssistantConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Inner(config)
        outer, inner = config.backbone_hidden_size, config.text.hidden_size
        self.pre_projection = nn.Linear(2 * outer, inner, bias=False)
        self.post_projection = nn.Linear(inner, outer, bias=False)
        if config.use_ordered_embeddings:
            self.masked_embedding = _MaskedEmbedding(config)
        if not config.tie_word_embeddings:  # present, but the masked head wins when both are
            self.lm_head = nn.Linear(inner, config.text.vocab_size, bias=False)
        self._link: _TargetLink | None = None

    def shared_layers(self, target: Any) -> dict[str, int]:
        """{layer type: target layer index} of the caches the drafter reads."""
        text = getattr(target, "language_model", target)
        return _shared_layers(self.config, _target_args(dataclasses.asdict(text.args)))

    def bind(self, target: Any) -> Gemma4AssistantModel:
        """Check the target fits and take its input embedding and shared layer indices."""
        text = getattr(target, "language_model", target)
        check_fits(self.config, dataclasses.asdict(text.args))
        scale = float(text.model.embed_scale)
        self._link = _TargetLink(text.model.embed_tokens, scale, self.shared_layers(text))
        return self

    def kv_from_cache(self, cache: list) -> dict[str, tuple[mx.array, mx.array]]:
        """The valid K/V slots of one sequence's target cache (KVCache / RotatingKVCache),
        as views; nothing is written to the cache."""
        out = {}
        for kind, index in self._bound().layers.items():
            c = cache[index]
            if not isinstance(c.offset, int):
                raise TypeError("batched caches: pass K/V arrays to step() with kv_lengths")
            n = min(c.offset, c.keys.shape[2])
            out[kind] = (c.keys[..., :n, :], c.values[..., :n, :])
        return out

    def step(
        self,
        tokens: mx.array,
        hidden: mx.array,
        kv: Mapping[str, tuple[mx.array, mx.array]],
        position: Lengths,
        kv_lengths: Lengths | Mapping[str, Lengths] | None = None,
        masks: Mapping[str, mx.array] | None = None,
    ) -> tuple[mx.array, mx.array]:
        """One drafting step: (logits (B, 1, V) over the target vocabulary, the state to
        pass as `hidden` to the next chained step (B, 1, H_target)).

        tokens (B, 1): the token to embed. hidden (B, 1, H_target): the target's final-norm
        output at its newest position, or the previous step's returned state. kv: {layer
        type: (keys, values)}, each (B, kv_heads, S, head_dim), read only. position: the
        query's RoPE position, the target's valid length T - 1, int or (B,); constant across
        a round. kv_lengths: T (int, (B,), or per layer type); a row reads its first
        min(T, S) slots, sliding layers only the newest `sliding_window` of them; None
        means every slot is valid. masks: {layer type: bool (B, S)}, True = readable;
        replaces the lengths for that layer (the caller then owns the window too).
        """
        link = self._bound()
        x = mx.concatenate([link.embed(tokens) * link.scale, hidden], axis=-1)
        h = self.pre_projection(x)
        layer_masks = {
            kind: self._mask(kind, kv[kind][0].shape[2], kv_lengths, masks) for kind in link.layers
        }
        for layer in self.model.layers:
            kind = layer.layer_type
            h, _, _ = layer(h, layer_masks[kind], None, shared_kv=kv[kind], offset=position)
        h = self.model.norm(h)
        return self._head(h), self.post_projection(h)

    def _bound(self) -> _TargetLink:
        if self._link is None:
            raise RuntimeError("bind(target) must come before drafting")
        return self._link

    def _head(self, h: mx.array) -> mx.array:
        if self.config.use_ordered_embeddings:
            return self.masked_embedding(h, self.model.embed_tokens.weight)
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def _mask(
        self,
        kind: str,
        slots: int,
        kv_lengths: Lengths | Mapping[str, Lengths] | None,
        masks: Mapping[str, mx.array] | None,
    ) -> mx.array | None:
        """Boolean (B or 1, 1, 1, S) readable slots, or None when every slot is."""
        if masks is not None and kind in masks:
            return masks[kind].reshape(masks[kind].shape[0], 1, 1, slots)
        lengths = kv_lengths.get(kind) if isinstance(kv_lengths, Mapping) else kv_lengths
        window = self.config.text.sliding_window if kind == SLIDING else None
        if lengths is None:
            lengths = slots
        if not isinstance(lengths, mx.array):
            n = min(int(lengths), slots)
            low = n - window if window is not None and n > window else 0
            if n == slots and low == 0:
                return None
            lengths, lows = mx.array([n]), mx.array([low])
        else:
            lengths = mx.minimum(lengths.astype(mx.int32).reshape(-1), slots)
            lows = mx.maximum(lengths - window, 0) if window is not None else mx.zeros_like(lengths)
        index = mx.arange(slots)[None, :]
        keep = (index < lengths[:, None]) & (index >= lows[:, None])
        return keep[:, None, None, :]


def _sanitize(weights: dict[str, mx.array], cfg: Gemma4AssistantConfig, dtype: mx.Dtype) -> dict:
    out = {}
    for key, value in weights.items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied copy some exports carry
        if any(part in key for part in _UNUSED_WEIGHTS):
            continue
        if key == "masked_embedding.token_ordering":
            out[key] = value.astype(mx.int32)  # published as int64; only ever an index
        else:
            out[key] = value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
    return out


def load_gemma4_assistant(folder: Path, dtype: mx.Dtype = mx.bfloat16) -> Gemma4AssistantModel:
    """The assistant from `folder` (config.json and *.safetensors in the published key
    names), every weight required and none left over. Call `bind(target)` before drafting."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if not is_gemma4_assistant_config(config):
        raise ValueError(f"{folder} is not a Gemma-4 assistant (model_type gemma4_assistant)")
    if config.get("quantization") or config.get("quantization_config"):
        # The masked head gathers raw embedding rows; packed quantized rows would be garbage.
        raise ValueError(f"{folder}: quantized Gemma-4 assistants are not supported")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))
    cfg = Gemma4AssistantConfig.from_config(config)
    model = Gemma4AssistantModel(cfg)
    model.load_weights(list(_sanitize(weights, cfg, dtype).items()), strict=True)
    mx.eval(model.parameters())
    return model
