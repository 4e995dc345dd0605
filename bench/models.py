"""Benchmark models: named shortcuts for the models our speed claims use.

`wide-stories` is the real stories260K widened (zero-padded) to ~95M parameters: the
same text at a realistic per-token cost (see `bench/widen.py`); `wide-salty` is the
same for the weaker saltyduckegg model. `random-100m` is a ~100M-parameter random
Llama (12 layers, hidden 768) with the demo tokenizer; `hybrid-mtp-170m` a random ~170M
Qwen3.5-shaped hybrid (12 layers, hidden 1024) with an MTP head (`bench/hybrid_mtp.py`).
The tiny real TinyStories models (~0.3M parameters) alone cannot show speed: their
steps are all overhead.
"""

from __future__ import annotations

from pathlib import Path

from engines.model.demo import TinyModelSpec, build_tiny_model, default_demo_dir
from engines.model.packaged_models import CATALOGUE
from engines.model.registry import model_folder

SHARED_MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"

REALISTIC_SPEC = TinyModelSpec(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    intermediate_size=2816,
    max_position_embeddings=4096,
    seed=0,
)


def widened(src: Path, out: Path) -> Path:
    """`src` zero-padded to ~95M parameters: the same function at a realistic cost."""
    from bench.widen import widen

    if not (out / "model.safetensors").exists():
        widen(src, out, hidden=1024, intermediate=4096, layers=6)
    return out


def resolve_model(name: str) -> str:
    """A path for `name`: demo, random-100m, hybrid-mtp-170m, wide-stories, stories260K,
    saltyduckegg, a packaged real model (smollm2-135m, qwen2.5-coder-0.5b,
    qwen2.5-coder-1.5b), or a path / hub id passed through."""
    cache = default_demo_dir().parent
    if name == "demo":
        return str(build_tiny_model(default_demo_dir()))
    if name == "random-100m":
        return str(build_tiny_model(cache / "random-100m", REALISTIC_SPEC))
    if name == "hybrid-mtp-170m":  # a Qwen3.5-shaped hybrid whose MTP head mostly agrees
        from bench.hybrid_mtp import build_hybrid_mtp

        return str(
            build_hybrid_mtp(cache / "hybrid-mtp-170m", build_tiny_model(default_demo_dir()))
        )
    if name == "wide-stories":
        return str(widened(SHARED_MODELS / "stories260K", cache / "wide-stories260K"))
    if name == "wide-salty":
        return str(widened(SHARED_MODELS / "tinystories-280K-saltyduckegg", cache / "wide-salty"))
    if name == "stories260K":
        return str(SHARED_MODELS / "stories260K")
    if name == "saltyduckegg":
        return str(SHARED_MODELS / "tinystories-280K-saltyduckegg")
    if name in CATALOGUE:  # a real model from its registry packages, as a folder
        return model_folder(name)
    return name
