"""Random-weight models of realistic size for a device check, built on the device.

A lent GPU machine has no network, so `tandem bench device` cannot download a model;
cost is shape, not weights, so it builds them (bfloat16, the demo tokenizer with its
vocabulary padded to a realistic size by plain added tokens):

* `llama-1b`, `llama-8b`: Llama-shaped targets (hidden 2048 x 16 layers, 4096 x 32,
  vocabulary 32000: 1.1B and 7.2B parameters). Their first `draft_layers` layers are
  strong (the demo's scaled weights, so output depends on context); the rest add a
  small residual (`AGREEMENT_SCALE`), so ...
* `llama-1b-draft`, `llama-8b-draft`: ... the target's own first layers with the same
  embeddings, final norm and LM head (shared weights) compute nearly the target's
  function at a fraction of its cost: an aligned draft whose acceptance is high but
  not total, as a trained draft's.
* `llama-1b-loop`: the 1B shape whose output repeats: weak layers and an LM head that
  maps each token's embedding to the next token of a fixed cycle (`LOOP_PERIOD`), so
  greedy output runs around short cycles, as a weak model falls into loops: prompt
  lookup's case.
* `hybrid-mtp-1b`: a Qwen3.5-shaped hybrid (gated delta net : attention 3 : 1) with an
  MTP head that reproduces the target's next-token path (`bench.hybrid_mtp.add_mtp_head`).

Special tokens get zero LM-head rows, so no random model ends at EOS (mlx_lm.server
ignores `ignore_eos`; equal work needs output that runs to max_tokens). `--profile dry`
builds the same kinds at toy sizes for the CPU dry run.

    python -m bench.device_models OUT [--profile full|dry] [--only llama-1b,...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from engines.model.demo import LAYER_WEIGHT_SCALE, TinyModelSpec, build_tiny_model

# Relative output scale of the target's layers past the draft's: sets how often the
# aligned draft's greedy token differs from the target's. At the 1B shape (float32, this
# CPU) the draft's argmax equalled the target's at 77% / 54% / 25% of 96 random-token
# positions for 0.05 / 0.1 / 0.2, and at 24 of 24 positions of the target's own greedy
# output for 0.05: a trained draft's 60-90% lies between.
AGREEMENT_SCALE = 0.1
# The looping model's layers add this much to a unit-RMS embedding: the cycle mostly
# wins, and now and then the context tips a token elsewhere.
LOOP_RESIDUAL = 0.1
LOOP_PERIOD = 16
DTYPE = "bfloat16"


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    draft_layers: int

    def spec(self, layers: int | None = None) -> TinyModelSpec:
        return TinyModelSpec(
            hidden_size=self.hidden,
            num_hidden_layers=layers or self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            intermediate_size=self.intermediate,
            max_position_embeddings=8192,
        )


PROFILES = {
    "full": {
        "vocab": 32000,
        "llama-1b": LlamaShape(2048, 16, 32, 8, 8192, 2),
        "llama-8b": LlamaShape(4096, 32, 32, 8, 14336, 4),
        "hybrid": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 6144},
    },
    "dry": {
        "vocab": 1024,
        "llama-1b": LlamaShape(128, 4, 4, 2, 256, 1),
        "llama-8b": LlamaShape(192, 6, 6, 2, 384, 2),
        "hybrid": {"hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256},
    },
}
KINDS = ("llama-1b", "llama-1b-loop", "llama-8b", "hybrid-mtp-1b")


def padded_tokenizer(out: Path, vocab: int) -> Path:
    """The demo tokenizer with plain added tokens `<xN>` up to `vocab` entries."""
    from transformers import PreTrainedTokenizerFast

    if (out / "tokenizer.json").exists():
        return out
    tiny = build_tiny_model(out.parent / "demo-tokenizer")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tiny))
    tokenizer.add_tokens([f"<x{i}>" for i in range(vocab - len(tokenizer))])
    tokenizer.save_pretrained(str(out))
    return out


def special_ids(tokenizer_dir: Path) -> list[int]:
    from transformers import PreTrainedTokenizerFast

    return list(PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir)).all_special_ids)


def llama_weights(shape: LlamaShape, vocab: int, layers: int, seed: int, loop: bool):
    """Random Llama weights: the first `shape.draft_layers` layers strong, the rest
    weak (a small residual); with `loop`, every layer weak and a cycling LM head."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = llama_config(shape.spec(layers), vocab)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for name, value in list(weights.items()):
        if not name.startswith("model.layers.") or "norm" in name:
            continue
        index = int(name.split(".")[2])
        strong = index < shape.draft_layers and not loop
        scale = LAYER_WEIGHT_SCALE if strong else 1.0
        if not strong and name.endswith(("o_proj.weight", "down_proj.weight")):
            scale = LOOP_RESIDUAL if loop else LAYER_WEIGHT_SCALE * AGREEMENT_SCALE
        weights[name] = value * scale
    if loop:
        embed = weights["model.embed_tokens.weight"]
        embed = embed * mx.rsqrt(mx.mean(embed * embed, axis=-1, keepdims=True))
        weights["model.embed_tokens.weight"] = embed
        weights["lm_head.weight"] = cycling_head(embed, seed)
    # half the memory from here on (an 8B model in float32 is 29 GB)
    return config, {name: value.astype(mx.bfloat16) for name, value in weights.items()}


def cycling_head(embed, seed: int):
    """LM-head rows so that token t's embedding scores `cycle(t)` highest: a
    permutation of the vocabulary into cycles of `LOOP_PERIOD` tokens."""
    import mlx.core as mx

    vocab = embed.shape[0]
    order = mx.random.permutation(vocab, key=mx.random.key(seed + 1))
    following = mx.zeros((vocab,), dtype=mx.int32)
    nxt = mx.concatenate(
        [mx.roll(order[i : i + LOOP_PERIOD], -1) for i in range(0, vocab, LOOP_PERIOD)]
    )
    following = following.at[order].add(nxt)  # following[t] = the token after t
    return mx.zeros_like(embed).at[following].add(embed)


def llama_config(spec: TinyModelSpec, vocab: int) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": DTYPE,
    }


def save(out: Path, tokenizer_dir: Path, config: dict, weights: dict, eos: list[int]) -> Path:
    """Weights in bfloat16 with the special tokens' LM-head rows zeroed, the padded
    tokenizer beside them: a folder `mlx_lm.load` and `tandem serve` take."""
    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    for item in tokenizer_dir.iterdir():
        if item.is_file() and not item.name.startswith(("config", "model", "tandem")):
            shutil.copy(item, out / item.name)
    specials = mx.array(special_ids(tokenizer_dir))
    weights = {name: value.astype(mx.bfloat16) for name, value in weights.items()}
    for name in [n for n in weights if n.endswith("lm_head.weight") and "mtp" not in n]:
        weights[name] = weights[name].at[specials].multiply(0)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}, indent=2))
    return out


def build_llama_pair(root: Path, name: str, shape: LlamaShape, vocab: int, tok: Path) -> dict:
    """`name` and `name-draft`: the draft is the target's first layers, same embeddings."""
    config, weights = llama_weights(shape, vocab, shape.layers, seed=1, loop=False)
    eos = eos_ids(tok)
    save(root / name, tok, config, dict(weights), eos)
    draft_config = {**config, "num_hidden_layers": shape.draft_layers}
    kept = {
        key: value
        for key, value in weights.items()
        if not key.startswith("model.layers.") or int(key.split(".")[2]) < shape.draft_layers
    }
    save(root / f"{name}-draft", tok, draft_config, kept, eos)
    return {name: str(root / name), f"{name}-draft": str(root / f"{name}-draft")}


def eos_ids(tok: Path) -> list[int]:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tok))
    return [tokenizer.convert_tokens_to_ids(t) for t in ("</s>", "<|im_end|>")]


def build_hybrid(root: Path, overrides: dict, vocab: int, tok: Path) -> dict:
    """A Qwen3.5-shaped hybrid with a copy MTP head (`bench.hybrid_mtp`), bfloat16."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5

    from bench.hybrid_mtp import HYBRID_170M, add_mtp_head

    config = {**HYBRID_170M, **overrides, "vocab_size": vocab, "torch_dtype": DTYPE}
    mx.random.seed(3)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    head = add_mtp_head(model, config, "copy", 3)
    weights = {**dict(tree_flatten(model.parameters())), **head}
    save(root / "hybrid-mtp-1b", tok, config, weights, eos_ids(tok))
    return {"hybrid-mtp-1b": str(root / "hybrid-mtp-1b")}


def build(root: Path, profile: str, only: list[str]) -> dict:
    """Every kind in `only` under `root`; returns {name: path} and what each took."""
    settings = PROFILES[profile]
    tok = padded_tokenizer(root / "tokenizer", settings["vocab"])
    built: dict = {"profile": profile, "vocab": settings["vocab"], "paths": {}, "seconds": {}}
    for kind in only:
        started = time.perf_counter()
        names = [kind, f"{kind}-draft"] if kind in ("llama-1b", "llama-8b") else [kind]
        if (root / names[-1] / "config.json").exists():  # written last: the folder is whole
            built["paths"].update({name: str(root / name) for name in names})
            print(f"reused {kind}", flush=True)
            continue
        if kind in ("llama-1b", "llama-8b"):
            paths = build_llama_pair(root, kind, settings[kind], settings["vocab"], tok)
        elif kind == "llama-1b-loop":
            shape = settings["llama-1b"]
            config, weights = llama_weights(shape, settings["vocab"], shape.layers, 2, loop=True)
            paths = {kind: str(save(root / kind, tok, config, weights, eos_ids(tok)))}
        elif kind == "hybrid-mtp-1b":
            paths = build_hybrid(root, settings["hybrid"], settings["vocab"], tok)
        else:
            raise SystemExit(f"unknown model kind {kind!r}; kinds: {', '.join(KINDS)}")
        built["paths"].update(paths)
        built["seconds"][kind] = round(time.perf_counter() - started, 1)
        print(f"built {kind} in {built['seconds'][kind]} s: {', '.join(paths)}", flush=True)
    built["parameters"] = {name: parameter_count(Path(p)) for name, p in built["paths"].items()}
    return built


def parameter_count(folder: Path) -> int:
    import mlx.core as mx

    return sum(value.size for value in mx.load(str(folder / "model.safetensors")).values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--profile", choices=tuple(PROFILES), default="full")
    parser.add_argument("--only", default=",".join(KINDS))
    args = parser.parse_args(argv)
    built = build(args.out, args.profile, args.only.split(","))
    (args.out / "models.json").write_text(json.dumps(built, indent=2))
    print(json.dumps(built["parameters"]))


if __name__ == "__main__":
    main()
