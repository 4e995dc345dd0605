"""`tandem bench rollback MODEL`: what a verify and its rollback cost on this machine,
relative to a plain decode step, for the model's own cache kinds.

A verify feeds T tokens in one forward; after it, the rejected positions go. Plain KV
caches trim them (free); recurrent (`ArraysCache`) caches cannot, so Tandem restores the
state from before the verify and replays the accepted run (`engines/cache/rollback.py`):
through the recurrent layers alone, from their inputs captured during the verify, where
the other layers are plain KV caches (they trim); through the whole model otherwise.
mlx-lm's sliding-window caches (`RotatingKVCache`) cannot trim either; Tandem gives
those layers windows kept in order that trim (`ragged_cache.trimmable_windows`), and
for such a model this prints both: mlx-lm's caches (a whole-model replay) and
Tandem's (a trim), with the plain step each runs at. This prints,
at a given context length, the median seconds of a plain step, of a T-token verify,
and of the rollback after it when half the draft was accepted, each as a ratio to
the plain step: the price drafting must beat on this model.

For a model with a multi-token-prediction head (Qwen3.5/3.6, Qwen3-Next) it also
prints what one MTP draft token costs against a plain step (a head of the model's
shape; its weights do not change the cost).

MODEL is a path or hub id; `random:qwen3_5` / `random:qwen3_next` / `random:lfm2` /
`random:gpt_oss` (sliding windows of 128 alternating with full attention) build a
random model of that mlx-lm architecture at about 100M parameters offline (cost is
shape, not weights). On a Mac, e.g. `tandem bench rollback mlx-community/Qwen3.5-4B-4bit`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

# Qwen3-Next and Qwen3.5 alike: gated-delta linear attention, one full-attention layer in 4
_GATED_DELTA = {
    "num_hidden_layers": 12,
    "full_attention_interval": 4,
    "head_dim": 64,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "linear_num_value_heads": 16,
    "linear_num_key_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
}
# Cost is shape, not weights: random ones, about 100M parameters of each architecture.
RANDOM = {
    "qwen3_next": {
        **_GATED_DELTA,
        "intermediate_size": 2048,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 1024,
        "moe_intermediate_size": 512,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
    },
    "qwen3_5": {
        **_GATED_DELTA,
        "intermediate_size": 3072,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1,
    },
    "lfm2": {
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 1024,
        "block_ff_dim": 4096,
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "conv", "full_attention"] * 4,
        "rope_theta": 1000000.0,
    },
    "gpt_oss": {
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 1536,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 6,
    },
}


def random_model(arch: str):
    """A random `arch` model of about 100M parameters, and its config."""
    import importlib

    config = {
        "model_type": arch,
        "hidden_size": 1024,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        **RANDOM[arch],
    }
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model, config


def mtp_step_ratio(model, config: dict, repeats: int) -> float | None:
    """One MTP draft token / a pipelined plain step, as the engine measures it at
    start-up (`CostModel.measure`), for a head of the model's shape (None: no head)."""
    from engines.gating.measured_costs import CostModel
    from engines.model.mtp import (
        MTP_ARCHS,
        MTPStepModel,
        TargetParts,
        build_head,
        mtp_layers_in_config,
    )

    if config.get("model_type") not in MTP_ARCHS or not mtp_layers_in_config(config):
        return None
    head = build_head(config)
    head.set_dtype(TargetParts(model).dtype)
    step = MTPStepModel(head, TargetParts(model))
    return CostModel.measure(model, step, 1, rounds=repeats).draft_step


def main(argv: list[str]) -> None:
    from engines.cache.ragged_cache import trimmable_windows
    from engines.platform.blas import describe_blas

    parser = argparse.ArgumentParser(prog="tandem bench rollback", description=__doc__)
    parser.add_argument(
        "model", help="path or hub id, or random:ARCH (qwen3_5, qwen3_next, lfm2, gpt_oss)"
    )
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tokens", default="2,4,8", help="verify widths T")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)

    if args.model.startswith("random:"):
        model, config = random_model(args.model.split(":", 1)[1])
    else:
        from mlx_lm import load

        model, _, config = load(args.model, return_config=True)
    print(
        f"model {args.model}: context {args.context}; {mx.default_device()}, BLAS {describe_blas()}"
    )
    mtp = mtp_step_ratio(model, config, args.repeats)
    if mtp is not None:
        print(f"MTP draft token / pipelined plain step {mtp:.2f} (the model's own head)")
    measure(model, args)
    if trimmable_windows(model):  # the same model with the windows Tandem serves it with
        measure(model, args)


def measure(model, args) -> None:
    """The table for the model's caches as `make_prompt_cache` makes them now."""
    from engines.cache.rollback import capturing_inputs, roll_back, take_snapshot

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((1, args.context), dtype=mx.int32), cache=cache))
    kinds = sorted({type(layer).__name__ for layer in cache})
    base_state = take_snapshot(cache)  # the context alone (None: the caches trim)

    def feed(count: int):
        return model(mx.ones((1, count), dtype=mx.int32), cache=cache)

    def verify_and_roll_back(count: int, keep: int, capture: bool) -> tuple[float, float]:
        """Seconds of a `count`-token verify, and of rolling back all but its first
        `keep` positions (the last token and the accepted drafts) -- a trim, or
        replaying the recurrent layers alone from the verify's captured inputs, or the
        whole model; then back to the bare context for the next repeat."""
        snapshot = take_snapshot(cache)
        started = time.perf_counter()
        with capturing_inputs(model, cache, snapshot if capture else None):
            mx.eval(feed(count))
        verified = time.perf_counter()
        roll_back(cache, count - keep, snapshot, model, [1] * keep)
        done = time.perf_counter()
        roll_back(cache, keep, base_state)
        return verified - started, done - verified

    def medians(count: int, keep: int, capture: bool = True) -> tuple[float, float]:
        verify_and_roll_back(count, keep, capture)  # warm-up
        runs = [verify_and_roll_back(count, keep, capture) for _ in range(args.repeats)]
        return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)

    base, _ = medians(1, 1)
    print(f"caches {', '.join(kinds)}: plain step {base * 1000:.1f} ms (median of {args.repeats})")
    if base_state is None:
        print("| T | verify / plain | rollback after it, T/2 kept / plain: a trim |")
        print("|---|---|---|")
        for count in (int(t) for t in args.tokens.split(",")):
            verify, back = medians(count, count // 2)
            print(f"| {count} | {verify / base:.2f} | {back / base:.2f} |")
        return
    print(
        "| T | verify / plain | rollback after it, T/2 kept / plain: "
        "recurrent layers replayed (Tandem) | whole model replayed |"
    )
    print("|---|---|---|---|")
    for count in (int(t) for t in args.tokens.split(",")):
        verify, back = medians(count, count // 2)
        _, whole = medians(count, count // 2, capture=False)
        print(f"| {count} | {verify / base:.2f} | {back / base:.2f} | {whole / base:.2f} |")
