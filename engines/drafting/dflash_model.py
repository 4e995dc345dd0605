"""DFlash (z-lab's block-diffusion drafter) as an MLX module, for one sequence or a
ragged batch of rows.

Why: a DFlash drafter proposes a whole block in ONE forward. The block is
`[bonus token, mask x (L-1)]`; its queries attend, non-causally, to the block itself and
to a per-row cache of context K/V built from the target's own hidden states (the
outputs of a few target layers, concatenated and projected by `fc`). Its logits come
from the target's LM head, so the drafter ships neither an embedding nor a head.

Only the context's K/V are cached (projected from the same `hidden_norm(fc(features))`
at every layer); the block's K/V are recomputed each call and never kept. Rows keep
their own lengths (`RaggedKVCache`): row i's new context goes at its own positions and
masks hide each row's padding, so a row gets the same logits batched as alone.

Format pitfalls of the published checkpoints (`config.json` + safetensors):
- `dflash_config.target_layer_ids[i]` is the OUTPUT of target decoder layer i, i.e.
  HF's `hidden_states[i + 1]` (index 0 there is the embedding output).
- `mask_token_id` lies past the tokenizer (an extra row of the target's embedding):
  check it against the embedding's rows, never against a tokenizer.
- `block_size` and `final_logit_softcapping` sit at the top level or, in newer
  revisions, inside `dflash_config`; `rope_theta` may sit inside `rope_parameters`.
- Weights may be prefixed `model.` and may carry copies of `embed_tokens`/`lm_head`
  (ignored: the target's are used).
- Variants with other math (DFlash2's convolutions and selector, sliding or causal
  layers, logit multipliers, other projectors) are refused, not run wrongly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.rope_utils import initialize_rope

from engines.cache.ragged_cache import RaggedKVCache


class DrafterMismatch(ValueError):
    """The drafter's config or weights do not fit this module or the target."""


def is_dflash_config(config: dict) -> bool:
    """Whether an HF `config.json` describes a DFlash drafter."""
    names = config.get("architectures") or []
    return "dflash_config" in config or any("dflash" in str(n).lower() for n in names)


# Settings of DFlash variants whose math this module does not do, each with the value
# that means "not used" (as absence does): such checkpoints are refused, not mis-run.
_NOT_USED: dict[str, Any] = {
    **dict.fromkeys(["conv_kernel_size", "selector_rank", "causal", "is_causal"], False),
    **dict.fromkeys(["dflash_query_causal", "attention_sink_bias", "attention_bias"], False),
    **dict.fromkeys(["output_multiplier", "input_embedding_scale"], 1.0),
    "projector_type": "dflash",
    "attention_mode": "gqa",
}


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None  # None: the config does not say
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 32768
    final_logit_softcapping: float | None = None

    @classmethod
    def from_config(cls, config: dict) -> DFlashConfig:
        """Read a published `config.json` (fields at the top level or in `dflash_config`)."""
        inner = config.get("dflash_config") or {}

        def get(name: str, default: Any = None) -> Any:
            return inner.get(name, config.get(name, default))

        for name, neutral in _NOT_USED.items():
            if get(name, neutral) not in (neutral, None):
                raise DrafterMismatch(f"unsupported DFlash variant: {name}={get(name)!r}")
        if any(kind != "full_attention" for kind in config.get("layer_types") or []):
            raise DrafterMismatch("unsupported DFlash variant: layer_types not all full_attention")
        heads = _require(config, "num_attention_heads")
        theta, scaling = _rope(config)
        return cls(
            hidden_size=_require(config, "hidden_size"),
            intermediate_size=_require(config, "intermediate_size"),
            num_hidden_layers=_require(config, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=_require(config, "vocab_size"),
            mask_token_id=int(_require(inner, "mask_token_id", config)),
            target_layer_ids=tuple(int(i) for i in _require(inner, "target_layer_ids", config)),
            num_target_layers=get("num_target_layers"),
            block_size=int(get("block_size", 16)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
            final_logit_softcapping=get("final_logit_softcapping"),
        )


def _require(config: Mapping, name: str, fallback: Mapping | None = None) -> Any:
    value = config.get(name, (fallback or {}).get(name))
    if value is None:
        raise DrafterMismatch(f"the DFlash config has no {name}")
    return value


def _rope(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from `rope_theta`/`rope_scaling` or HF v5's `rope_parameters`
    (possibly keyed by layer type); a "default" type means no scaling."""
    params = dict(config.get("rope_parameters") or {})
    params = dict(params.get("full_attention", params))
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = params or config.get("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type")) in (None, "default"):
        scaling = None
    return theta, scaling


def tap_layers(config: DFlashConfig | dict) -> tuple[int, ...]:
    """The target decoder layers whose OUTPUTS the drafter reads, in `fc`'s input order."""
    if isinstance(config, dict):
        config = DFlashConfig.from_config(config)
    return config.target_layer_ids


def check_fits(
    config: DFlashConfig, target_hidden_size: int, target_layers: int, target_vocab: int
) -> None:
    """Raise `DrafterMismatch` unless the drafter was made for a target of this shape
    (`target_vocab`: the rows of the target's embedding, which hold the mask token)."""
    if config.hidden_size != target_hidden_size:
        raise DrafterMismatch(
            f"hidden_size {config.hidden_size} differs from the target's {target_hidden_size}"
        )
    for layer in config.target_layer_ids:
        if not 0 <= layer < target_layers:
            raise DrafterMismatch(f"target_layer_id {layer} is not among {target_layers} layers")
    if config.num_target_layers is not None and config.num_target_layers != target_layers:
        raise DrafterMismatch(
            f"num_target_layers {config.num_target_layers} differs from the target's"
            f" {target_layers}"
        )
    if not 0 <= config.mask_token_id < target_vocab:
        raise DrafterMismatch(
            f"mask_token_id {config.mask_token_id} is past the target's {target_vocab}"
            " embedding rows"
        )


Offset = int | mx.array  # one row: an int; rows: (B,) per-row positions


class Attention(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.scale = c.head_dim**-0.5
        self.q_proj = nn.Linear(c.hidden_size, self.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)

    def __call__(self, x, ctx, cache: RaggedKVCache, rope, offsets, mask) -> mx.array:
        """x: the block (B, L, D); ctx: new context hidden (B, S, D) or None;
        offsets: (context start, block start) per row."""
        B, L, _ = x.shape
        queries = rope(_split(self.q_norm, self.q_proj(x), self.heads), offset=offsets[1])
        keys = rope(_split(self.k_norm, self.k_proj(x), self.kv_heads), offset=offsets[1])
        values = _split(None, self.v_proj(x), self.kv_heads)
        cached = self._context(ctx, cache, rope, offsets[0])
        if cached is not None:
            keys = mx.concatenate([cached[0], keys], axis=2)
            values = mx.concatenate([cached[1], values], axis=2)
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=mask
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _context(self, ctx, cache: RaggedKVCache, rope, offset: Offset):
        """Every row's cached context K/V, after writing the new context (if any)."""
        if ctx is not None:
            keys = rope(_split(self.k_norm, self.k_proj(ctx), self.kv_heads), offset=offset)
            return cache.update_and_fetch(keys, _split(None, self.v_proj(ctx), self.kv_heads))
        width = max(cache.lengths)
        if cache.keys is None or width == 0:
            return None
        return cache.keys[..., :width, :], cache.values[..., :width, :]


def _split(norm: nn.Module | None, x: mx.array, heads: int) -> mx.array:
    """(B, T, heads*dim) -> (B, heads, T, dim), with the per-head norm if given."""
    x = x.reshape(*x.shape[:2], heads, -1)
    return (norm(x) if norm is not None else x).transpose(0, 2, 1, 3)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def __call__(self, x, ctx, cache, rope, offsets, mask) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), ctx, cache, rope, offsets, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass(frozen=True)
class _Target:
    """The target's parts the drafter borrows (a plain holder, so they stay out of the
    drafter's parameters)."""

    embed: Callable[[mx.array], mx.array]
    logits: Callable[[mx.array], mx.array]


class DFlashDraftModel(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        taps = len(config.target_layer_ids)
        self.fc = nn.Linear(taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [DecoderLayer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rope = initialize_rope(
            config.head_dim,
            config.rope_theta,
            False,  # NeoX (split-half) pairing, as Qwen3
            dict(config.rope_scaling) if config.rope_scaling else None,
            config.max_position_embeddings,
        )
        self._target: _Target | None = None

    def bind(
        self, embed_tokens: Callable[[mx.array], mx.array], logits: Callable[[mx.array], mx.array]
    ) -> DFlashDraftModel:
        """Borrow the target's embedding (tokens -> its first layer's input, scaled as the
        target scales it) and LM head (hidden -> logits)."""
        self._target = _Target(embed_tokens, logits)
        return self

    def make_cache(self) -> list[RaggedKVCache]:
        """One single-sequence context cache per layer."""
        return [RaggedKVCache([0]) for _ in self.layers]

    def draft_logits(
        self, features: mx.array, counts: list[int], block: mx.array, cache: list[RaggedKVCache]
    ) -> mx.array:
        """Target-head logits (B, L-1, V) for block positions 1..L-1.

        features (B, S, taps*hidden): row i's first counts[i] positions are new context,
        appended to its cache; block (B, L): [bonus, mask...] tokens. Afterwards every
        row's cache holds exactly its old length + counts[i] positions."""
        if self._target is None:
            raise RuntimeError("bind() the target's embedding and LM head first")
        lengths = list(cache[0].lengths)
        (B, L), S = block.shape, features.shape[1]
        if not (features.shape[0] == B == len(counts) == len(lengths)):
            raise ValueError("features, counts, block and cache must have the same rows")
        if any(not 0 <= n <= S for n in counts):
            raise ValueError(f"counts {counts} must lie within 0..{S}")
        visible = [length + n for length, n in zip(lengths, counts, strict=True)]
        offsets = (_per_row(lengths), _per_row(visible))
        ctx = self.hidden_norm(self.fc(features)) if S else None
        mask = _mask(visible, max(lengths) + S, L)
        h = self._target.embed(block)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h = layer(h, ctx, layer_cache, self.rope, offsets, mask)
        for layer_cache in cache:
            layer_cache.set_lengths(visible)
        logits = self._target.logits(self.norm(h[:, 1:]))
        cap = self.config.final_logit_softcapping
        return mx.tanh(logits / cap) * cap if cap else logits


def _per_row(values: list[int]) -> Offset:
    return values[0] if len(values) == 1 else mx.array(values)


def _mask(visible: list[int], width: int, block: int) -> mx.array | None:
    """(B, 1, 1, width + block): row i's queries see its context columns < visible[i]
    (not its padding nor stale columns) and every block position. None: all see all."""
    if all(v == width for v in visible):
        return None
    context = mx.arange(width)[None] < mx.array(visible)[:, None]
    every = mx.ones((len(visible), block), dtype=mx.bool_)
    return mx.concatenate([context, every], axis=1)[:, None, None, :]


def load_dflash(folder: Path, dtype: mx.Dtype) -> DFlashDraftModel:
    """The drafter in `folder` (published `config.json` and `*.safetensors`), floats cast
    to `dtype`. Raises `DrafterMismatch` when the weights do not fit its config."""
    folder = Path(folder)
    config = DFlashConfig.from_config(json.loads((folder / "config.json").read_text()))
    model = DFlashDraftModel(config)
    weights = _read_weights(folder)
    _check_weights(dict(tree_flatten(model.parameters())), weights)
    floats = {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()
    }
    model.load_weights(list(floats.items()), strict=True)
    mx.eval(model.parameters())
    return model


def _read_weights(folder: Path) -> dict[str, mx.array]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DrafterMismatch(f"no *.safetensors in {folder}")
    weights = {}
    for file in files:
        for key, value in mx.load(str(file)).items():
            key = key.removeprefix("model.")
            if key.split(".")[0] not in ("embed_tokens", "lm_head"):
                weights[key] = value
    return weights


def _check_weights(expected: dict[str, mx.array], weights: dict[str, mx.array]) -> None:
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    if missing or unexpected:
        raise DrafterMismatch(
            f"DFlash weights do not match the config: missing {missing[:5]},"
            f" unexpected {unexpected[:5]}"
        )
    for key, value in expected.items():
        if weights[key].shape != value.shape:
            raise DrafterMismatch(
                f"DFlash weight {key} has shape {tuple(weights[key].shape)},"
                f" the config needs {tuple(value.shape)}"
            )
