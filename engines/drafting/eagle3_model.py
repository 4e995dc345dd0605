"""An EAGLE-3 speculator (SpecForge or RedHatAI `speculators` checkpoints) in MLX.

EAGLE-3 drafts from the target's own features: the inputs of three target layers
(`aux_layer_ids`; id k is the INPUT of target layer k, i.e. the output of layer
k-1, and k=0 the embedding output), concatenated in id order, are fused by `fc`
into the drafter's width. Entry i of the drafter's KV cache is built from the pair
(fused hidden state at position i, token i+1): one decoder layer attends over
concat(input_layernorm(embed(token)), hidden_norm(hidden)), twice the width, so the
q/k/v projections are 2*hidden wide. `lm_head` scores a reduced draft vocabulary;
draft id d is target id d + d2t[d]. Chaining feeds the layer's output back as the
next hidden state BEFORE the final norm (as mlx-vlm and speculators do: `norm` only
feeds `lm_head`).

Rows are batched on Tandem's `RaggedKVCache`: each row keeps its own length, a
forward writes after it, and a mask built from the lengths before the write keeps
padding (at a row's end) out of every real position's attention, so a row's logits
are the same batched as alone. The engine cuts padded and rejected positions with
`set_lengths`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from engines.cache.ragged_cache import RaggedKVCache

_DROPPED = ("t2d", "verifier_", "rotary_emb.inv_freq")  # published, never used here


class DrafterMismatch(ValueError):
    """The EAGLE-3 checkpoint does not fit (its weights, or the target); says which field."""


def is_eagle3_config(config: dict) -> bool:
    """Whether a drafter's config.json is EAGLE-3, in either published format."""
    if config.get("speculators_model_type") == "eagle3":
        return True
    return any("eagle3" in str(arch).lower() for arch in config.get("architectures") or [])


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target vocabulary: the embedding's rows
    draft_vocab_size: int  # lm_head's rows
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    attention_bias: bool = False
    norm_before_residual: bool = False  # the residual is hidden_norm(hidden) (speculators)
    norm_before_fc: bool = False  # an RMSNorm over the tapped features before fc (gpt-oss)
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)

    @classmethod
    def from_config(cls, config: dict, target_layers: int) -> Eagle3Config:
        """Both formats: speculators nests the layer in `transformer_layer_config`;
        SpecForge is a flat Llama config with `eagle_config`. Null aux ids default to
        (2, L//2, L-3) of the TARGET's L layers (the drafter's own count is 1)."""
        layer = config.get("transformer_layer_config") or config
        hidden = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        rope = layer.get("rope_scaling") or layer.get("rope_parameters") or None
        theta = layer.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope is not None and rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = None
        ids = _find_aux_ids(config)
        if ids is None:
            ids = [2, target_layers // 2, target_layers - 3]
        return cls(
            hidden_size=hidden,
            intermediate_size=int(layer["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(layer.get("max_position_embeddings") or 131072),
            vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(config.get("draft_vocab_size") or layer["vocab_size"]),
            target_hidden_size=int(config.get("target_hidden_size") or hidden),
            aux_layer_ids=tuple(int(i) for i in ids),
            attention_bias=bool(layer.get("attention_bias", False)),
            norm_before_residual=bool(config.get("norm_before_residual", False)),
            norm_before_fc=bool(config.get("norm_before_fc", False)),
            rope_scaling=rope,
        )


def _find_aux_ids(config: dict) -> list[int] | None:
    """The aux ids wherever a format puts them (top level, `eagle_config`, the layer)."""
    key = "eagle_aux_hidden_state_layer_ids"
    for where in (config, config.get("eagle_config"), config.get("transformer_layer_config")):
        if isinstance(where, dict) and where.get(key) is not None:
            return list(where[key])
    return None


def check_fits(
    config: Eagle3Config,
    target_hidden_size: int,
    target_layers: int,
    target_vocab: int,
    d2t: mx.array | None = None,
) -> None:
    """Raise `DrafterMismatch` naming the field when the drafter was not trained for
    this target: its hidden size, a tapped layer it lacks, or a vocabulary it lacks."""
    if config.target_hidden_size != target_hidden_size:
        raise DrafterMismatch(
            f"target_hidden_size: the drafter fuses features {config.target_hidden_size} "
            f"wide, the target's hidden size is {target_hidden_size}"
        )
    for k in config.aux_layer_ids:
        if not 0 <= k <= target_layers:
            raise DrafterMismatch(
                f"eagle_aux_hidden_state_layer_ids: layer {k} is outside a target of "
                f"{target_layers} layers"
            )
    if config.vocab_size != target_vocab:
        raise DrafterMismatch(
            f"vocab_size: the drafter embeds {config.vocab_size} tokens, "
            f"the target has {target_vocab}"
        )
    if d2t is not None:
        mapped = mx.arange(d2t.shape[0]) + d2t.astype(mx.int32)
        low, high = int(mx.min(mapped).item()), int(mx.max(mapped).item())
        if low < 0 or high >= target_vocab:
            raise DrafterMismatch(
                f"d2t: maps draft ids to target id {high if high >= target_vocab else low}, "
                f"past the target's vocabulary of {target_vocab}"
            )


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.scale = c.head_dim**-0.5
        wide, bias = 2 * c.hidden_size, c.attention_bias
        self.q_proj = nn.Linear(wide, self.heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(wide, self.kv_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(wide, self.kv_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=bias)
        self.rope = initialize_rope(
            c.head_dim, c.rope_theta, False, c.rope_scaling, c.max_position_embeddings
        )

    def __call__(self, x: mx.array, cache: RaggedKVCache) -> mx.array:
        batch, n, _ = x.shape
        q = self.q_proj(x).reshape(batch, n, self.heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(batch, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(batch, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        # both from the lengths before this forward writes: per-row positions and mask
        offset, mask = cache.offset, cache.make_mask(n)
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, n, -1))


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """The drafter's decoder layer: attention over [embedding, hidden] (each normed),
    the residual stream carried by the hidden state."""

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.norm_before_residual = c.norm_before_residual
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = _MLP(c)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: RaggedKVCache) -> mx.array:
        normed = self.hidden_norm(hidden)
        x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        h = (normed if self.norm_before_residual else hidden) + self.self_attn(x, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3DraftModel(nn.Module):
    def __init__(self, config: Eagle3Config, own_embedding: bool = True) -> None:
        super().__init__()
        self.config = config
        c = config
        if own_embedding:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        fused = len(c.aux_layer_ids) * c.target_hidden_size
        if c.norm_before_fc:
            self.input_norm = nn.RMSNorm(fused, eps=c.rms_norm_eps)
        self.fc = nn.Linear(fused, c.hidden_size, bias=False)
        self.layers = [_Layer(c)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.d2t = mx.zeros((c.draft_vocab_size,), dtype=mx.int32)
        # the target's embedding when the checkpoint has none; kept out of the module
        # tree so it is neither loaded, cast, nor counted as the drafter's weights
        object.__setattr__(self, "_bound_embed", None)

    def bind(self, embed_tokens: Any) -> Eagle3DraftModel:
        """Embed tokens with the target's embedding (shared, quantized or not); a
        drafter with its own trained embedding keeps it."""
        if "embed_tokens" in self:
            return self
        width = embed_tokens(mx.array([0])).shape[-1]
        if width != self.config.hidden_size:
            raise DrafterMismatch(
                f"hidden_size: the drafter is {self.config.hidden_size} wide and has no "
                f"embedding of its own; the target's embedding is {width} wide"
            )
        object.__setattr__(self, "_bound_embed", embed_tokens)
        return self

    def embed(self, tokens: mx.array) -> mx.array:
        if "embed_tokens" in self:
            return self.embed_tokens(tokens)
        if self._bound_embed is None:
            raise RuntimeError("the EAGLE-3 drafter has no embedding: bind the target's")
        return self._bound_embed(tokens)

    def fuse(self, features: mx.array) -> mx.array:
        """Tapped target features (B, n, taps*target_hidden), in aux id order, to the
        drafter's hidden width (B, n, hidden)."""
        if "input_norm" in self:
            features = self.input_norm(features)
        return self.fc(features)

    def step(
        self, tokens: mx.array, hidden: mx.array, cache: list[RaggedKVCache]
    ) -> tuple[mx.array, mx.array]:
        """One forward over n pairs per row: (hidden[:, i], tokens[:, i]) is the fused
        state at position i and token i+1, causal over `cache` and each other.
        Returns (draft-vocab logits (B, n, draft_vocab), the layer's output (B, n,
        hidden) before the final norm: the next `hidden` when chaining)."""
        h = self.layers[0](self.embed(tokens).astype(hidden.dtype), hidden, cache[0])
        return self.lm_head(self.norm(h)), h

    def make_cache(self, rows: int = 1) -> list[RaggedKVCache]:
        return [RaggedKVCache([0] * rows)]

    def target_ids(self, draft_ids: mx.array) -> mx.array:
        """Draft-vocabulary ids to target ids (id + d2t[id])."""
        draft_ids = draft_ids.astype(mx.int32)
        return draft_ids + self.d2t[draft_ids]

    def target_logprobs(self, draft_logits: mx.array, target_vocab: int) -> mx.array:
        """The draft's distribution over the TARGET vocabulary, float32 log-probabilities:
        its softmax at the mapped ids, -inf at every id it cannot propose (the q that
        exact sampled verification divides by). d2t is injective, so no mass merges."""
        logits = draft_logits.astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        ids = self.target_ids(mx.arange(logp.shape[-1]))
        out = mx.full((*logp.shape[:-1], target_vocab), -mx.inf, dtype=mx.float32)
        return mx.put_along_axis(out, mx.broadcast_to(ids, logp.shape), logp, axis=-1)

    def check_fits(self, target_hidden_size: int, target_layers: int, target_vocab: int) -> None:
        check_fits(self.config, target_hidden_size, target_layers, target_vocab, self.d2t)


def load_eagle3(folder: Path, target_layers: int, dtype: mx.Dtype) -> Eagle3DraftModel:
    """The drafter in `folder` (config.json and *.safetensors, published key names),
    floats cast to `dtype`, d2t kept integer. Strict: a missing, extra or misshapen
    weight raises `DrafterMismatch`."""
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())
    if not is_eagle3_config(raw):
        raise DrafterMismatch(f"{folder}/config.json is not an EAGLE-3 drafter's")
    config = Eagle3Config.from_config(raw, target_layers)
    weights: dict[str, mx.array] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(_published_names(mx.load(str(file))))
    if not weights:
        raise DrafterMismatch(f"no *.safetensors weights in {folder}")
    if "d2t" not in weights and config.draft_vocab_size == config.vocab_size:
        weights["d2t"] = mx.zeros((config.draft_vocab_size,), dtype=mx.int32)
    weights = {
        k: v.astype(mx.int32) if k == "d2t" else v.astype(dtype) if _floating(v) else v
        for k, v in weights.items()
    }
    model = Eagle3DraftModel(config, own_embedding="embed_tokens.weight" in weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise DrafterMismatch(f"the weights in {folder} do not fit its config: {exc}") from exc
    mx.eval(model.parameters())
    model.eval()
    return model


def _published_names(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """SpecForge's `midlayer.*` is speculators' `layers.0.*`; vocabulary masks and
    verifier copies are dropped."""
    out = {}
    for key, value in weights.items():
        if any(part in key for part in _DROPPED):
            continue
        key = key.removeprefix("model.")
        if key.startswith("midlayer."):
            key = "layers.0." + key[len("midlayer.") :]
        out[key] = value
    return out


def _floating(array: mx.array) -> bool:
    return mx.issubdtype(array.dtype, mx.floating)
