"""A trained drafter on disk, and the state a killed run resumes from.

`OUT/` is always a drafter `tandem serve MODEL --draft-model OUT` loads: SpecForge's
EAGLE-3 format (`config.json` with `eagle_config`, `model.safetensors` with `midlayer.*`,
`fc`, `norm`, `lm_head`, `d2t` and `t2d`), the format vLLM and SGLang also read. The
embedding is the target's (not saved). `OUT/training_state/` holds what resuming needs:
the optimizer's state, the step and chunks consumed, and the settings the run began
with (a resume with other settings is refused, naming them). Every write goes to a
temporary name first and is renamed into place, so a kill at any moment leaves the
previous checkpoint whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from engines.drafting.eagle3_model import Eagle3Config, Eagle3DraftModel

STATE = "training_state"


def drafter_config(target_config: dict, aux_ids: tuple[int, ...], draft_vocab: int) -> dict:
    """SpecForge's config for a one-layer drafter shaped like one of the target's layers."""
    text = target_config.get("text_config", target_config)
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(text["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(text.get("num_key_value_heads") or heads),
        "head_dim": int(text.get("head_dim") or hidden // heads),
        "num_hidden_layers": 1,
        "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(text.get("rope_theta", 10000.0)),
        "max_position_embeddings": int(text.get("max_position_embeddings", 4096)),
        "vocab_size": int(text["vocab_size"]),
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids)},
        "torch_dtype": "float32",
        "tandem_trained": True,
    }


def new_drafter(config: dict, layers: int, draft_ids: list[int], seed: int) -> Eagle3DraftModel:
    """A drafter of `config` with fresh weights (seeded) over the draft vocabulary
    `draft_ids` (sorted target ids: d2t[d] = draft_ids[d] - d)."""
    mx.random.seed(seed)
    model = Eagle3DraftModel(Eagle3Config.from_config(config, layers), own_embedding=False)
    model.d2t = mx.array(draft_ids, dtype=mx.int32) - mx.arange(len(draft_ids), dtype=mx.int32)
    model.freeze(keys=["d2t"])
    mx.eval(model.parameters())
    return model


def _published(model: Eagle3DraftModel, vocab: int) -> dict[str, mx.array]:
    weights = {}
    for key, value in tree_flatten(model.parameters()):
        if key.startswith("layers.0."):
            key = "midlayer." + key[len("layers.0.") :]
        weights[key] = value
    ids = model.target_ids(mx.arange(model.d2t.shape[0]))
    t2d = mx.zeros((vocab,), dtype=mx.bool_)
    t2d[ids] = True
    weights["t2d"] = t2d
    return weights


def _replace_dir(build: Path, final: Path) -> None:
    """Move the finished `build` folder to `final`, the old one out of the way first."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(build, final)
    shutil.rmtree(old, ignore_errors=True)


def save(
    out: Path,
    config: dict,
    model: Eagle3DraftModel,
    optimizer: Any,
    progress: dict,
    settings: dict,
) -> None:
    """The drafter into `out` and the training state into `out/training_state`."""
    out.mkdir(parents=True, exist_ok=True)
    weights_tmp = out / "model.tmp.safetensors"  # (mx.save_safetensors keeps this suffix)
    mx.save_safetensors(str(weights_tmp), _published(model, int(config["vocab_size"])))
    config_tmp = out / "config.json.tmp"
    config_tmp.write_text(json.dumps(config, indent=2))
    build = out / f"{STATE}.tmp"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir()
    mx.save_safetensors(str(build / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    mx.save_safetensors(str(build / "weights.safetensors"), dict(tree_flatten(model.parameters())))
    (build / "progress.json").write_text(json.dumps({"settings": settings, **progress}, indent=2))
    # the drafter and its state are replaced together: state first, then the files
    _replace_dir(build, out / STATE)
    os.replace(config_tmp, out / "config.json")
    os.replace(weights_tmp, out / "model.safetensors")


def load_state(out: Path) -> dict | None:
    """The saved progress (with its settings), or None when `out` has no run to resume."""
    path = out / STATE / "progress.json"
    return json.loads(path.read_text()) if path.is_file() else None


def restore(out: Path, model: Eagle3DraftModel, optimizer: Any) -> None:
    """Weights and optimizer state exactly as saved (float32, bit for bit)."""
    state = out / STATE
    model.load_weights(list(mx.load(str(state / "weights.safetensors")).items()), strict=False)
    saved = mx.load(str(state / "optimizer.safetensors"))
    optimizer.state = tree_unflatten(list(saved.items()))
    mx.eval(model.parameters(), optimizer.state)
