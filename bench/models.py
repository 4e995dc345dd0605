"""Benchmark models: named shortcuts for the models our speed claims use.

`random-100m` is a ~100M-parameter random Llama (12 layers, hidden 768) with the
demo tokenizer: its per-token cost is realistic for this CPU, which the tiny real
TinyStories models (~0.3M parameters) cannot show.
"""

from __future__ import annotations

from pathlib import Path

from engines.demo import TinyModelSpec, build_tiny_model, default_demo_dir

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


def resolve_model(name: str) -> str:
    """A path for `name`: demo, random-100m, stories260K, saltyduckegg, or a real path."""
    cache = default_demo_dir().parent
    if name == "demo":
        return str(build_tiny_model(default_demo_dir()))
    if name == "random-100m":
        return str(build_tiny_model(cache / "random-100m", REALISTIC_SPEC))
    if name == "stories260K":
        return str(SHARED_MODELS / "stories260K")
    if name == "saltyduckegg":
        return str(SHARED_MODELS / "tinystories-280K-saltyduckegg")
    return name
