"""GGUF import: llama and qwen2 GGUF files become mlx-lm model folders.

People moving from LM Studio or Ollama have GGUF files on disk. `tandem serve
FILE.gguf` imports one into a folder in the cache keyed by the file's content hash
(a second start reuses it), then serves that folder like any mlx-lm model.

Weights are dequantized to float (`gguf.quants.dequantize`), float32 on the CPU
(MLX's CPU quantized matmul is slower than float32) and float16 on a GPU, and
renamed to Hugging Face names. llama.cpp stores the q and k rows of *llama* models
permuted for its rotary layout; they are permuted back (qwen2 is stored as is). The
tokenizer is rebuilt from the file's vocabulary with transformers' GGUF tokenizer
builders (which need no torch when fed metadata read here), with the file's chat
template. Anything else is refused with a message that names what is supported.
"""

from __future__ import annotations

import fcntl
import json
import logging
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from engines.model.cache_paths import remembered_sha256, tandem_cache_root

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
FORMAT_VERSION = 1  # bump when the imported folder's layout changes
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFImportError(ValueError):
    """The file is not a GGUF this importer supports; the message says why."""


def default_dtype() -> str:
    return "float32" if mx.default_device() == mx.cpu else "float16"


def import_gguf(path: str | Path, cache_dir: Path | None = None, dtype: str | None = None) -> Path:
    """The mlx-lm folder for `path`, importing it on first use (dtype: float32 on the
    CPU, float16 on a GPU, unless given)."""
    source = Path(path).expanduser()
    dtype = dtype or default_dtype()
    root = cache_dir or default_cache_dir()
    key = remembered_sha256(source, root / ".hashes")[:20]
    out = root / f"{key}-v{FORMAT_VERSION}-{dtype}"
    if (out / "tandem_gguf.json").exists():
        return out
    # Several processes may start on one file at once (the ranks of `mlx.launch` on one
    # machine, replicas): one imports, the others wait for it and use its folder.
    with (root / f"{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "tandem_gguf.json").exists():
            log.info("importing %s into %s (%s); once per file", source, out, dtype)
            convert_gguf(source, out, dtype)
    return out


def default_cache_dir() -> Path:
    return tandem_cache_root() / "gguf"


def convert_gguf(source: Path, out: Path, dtype: str = "float32") -> None:
    """Write config.json, model.safetensors and the tokenizer of `source` into `out`
    (built in a sibling folder and renamed, so a crash never leaves half a model)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(source))
    except Exception as exc:  # noqa: BLE001 - the gguf reader raises many kinds
        raise GGUFImportError(f"{source} is not a readable GGUF file: {exc}") from exc
    metadata = _metadata(reader)
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(
            f"{source}: GGUF architecture {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    config = model_config(architecture, metadata, [t.name for t in reader.tensors])
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    weights = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        array = _dequantized(source, tensor)
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"]
            if "k_proj" in name:
                heads = config["num_key_value_heads"]
            array = unpermute_rotary(array, heads)
        weights[name] = mx.array(array).astype(getattr(mx, dtype))
    mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    save_tokenizer(architecture, metadata, staging)
    (staging / "tandem_gguf.json").write_text(
        json.dumps({"source": str(source), "dtype": dtype, "format": FORMAT_VERSION})
    )
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def _metadata(reader) -> dict:
    """Every field's value (the tokenizer's long arrays included: about 5 s for
    SmolLM2's 49k-token vocabulary, paid once per import)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _dequantized(source: Path, tensor) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        flat = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        kind = GGMLQuantizationType(tensor.tensor_type).name
        raise GGUFImportError(f"{source}: tensor {tensor.name} has type {kind}: {exc}") from exc
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists ne0 first
    return np.ascontiguousarray(flat.reshape(shape), dtype=np.float32)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for tensors mlx-lm does not use
    (llama.cpp's precomputed rope frequencies)."""
    match = _BLOCK.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part not in _LAYER_NAMES:
            raise GGUFImportError(f"unexpected GGUF tensor {gguf_name}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem == "rope_freqs":
        return None
    if stem not in _TOP_NAMES:
        raise GGUFImportError(f"unexpected GGUF tensor {gguf_name}")
    return f"{_TOP_NAMES[stem]}.{kind}"


def unpermute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of q/k rows: its convert script stores each head's
    rows as (half, pair) where Hugging Face has (pair, half)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def model_config(architecture: str, metadata: dict, tensor_names: list[str]) -> dict:
    """An mlx-lm config.json for the file's hyperparameters."""

    def field(name: str, default=None):
        value = metadata.get(f"{architecture}.{name}", default)
        if value is None:
            raise GGUFImportError(f"GGUF metadata lacks {architecture}.{name}")
        return value

    hidden = int(field("embedding_length"))
    heads = int(field("attention.head_count"))
    vocab = metadata.get(f"{architecture}.vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    config = {
        "model_type": architecture,
        "hidden_size": hidden,
        "num_hidden_layers": int(field("block_count")),
        "intermediate_size": int(field("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field("attention.head_count_kv", heads)),
        "head_dim": int(field("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field("context_length")),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in metadata:
            config[key] = int(metadata[f"tokenizer.ggml.{key}"])
    return config


# The tokenizer's special tokens and the GGUF fields holding their ids. transformers keeps
# the same table as a private name that older 5.x releases lack, so it is written out here.
SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def save_tokenizer(architecture: str, metadata: dict, out: Path) -> None:
    """The file's tokenizer and chat template as a Hugging Face fast tokenizer."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    grouped = {
        group: {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokens, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokens.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)
    for name, key in SPECIAL_TOKEN_IDS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        config[name] = tokens["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(architecture, tokens)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
    tokenizer.save_pretrained(str(out))


def is_gguf(path: Path) -> bool:
    """A GGUF file, by its magic bytes (or its name, so a broken one is reported as a
    broken GGUF rather than as some other file)."""
    with path.open("rb") as handle:
        return handle.read(4) == b"GGUF" or path.suffix.lower() == ".gguf"
