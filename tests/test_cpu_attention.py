"""Head-parallel attention on a CPU device: bit-identical to mlx-lm's attention, for
every mask, head layout and sink MLX takes, and greedy decoding through the engines
stays token-identical to plain mlx-lm with the attention split."""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import base

from engines.model.registry import ModelRegistry
from engines.platform import cpu_attention
from engines.platform.cpu_attention import MIN_SCORES, HeadParallelAttention
from engines.sequence import make_sequence
from engines.single.engine import SpeculativeEngine
from engines.state import SpecConfig
from tests.test_batched_speculation import COST, greedy_request, make_engines, run_batch


@pytest.fixture
def on_cpu():
    """The split engages only on a CPU device: run these there on any machine."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(previous)


def attention_inputs(batch, heads, kv_heads, length, cached, dim=16, seed=0):
    key = mx.random.key(seed)
    q_key, k_key, v_key = mx.random.split(key, 3)
    queries = mx.random.normal((batch, heads, length, dim), key=q_key)
    keys = mx.random.normal((batch, kv_heads, cached, dim), key=k_key)
    values = mx.random.normal((batch, kv_heads, cached, dim), key=v_key)
    return queries, keys, values


def masks(batch, heads, length, cached):
    rows = mx.arange(cached - length, cached)[:, None]
    allowed = rows >= mx.arange(cached)[None]  # causal over a cache longer than the queries
    additive = mx.random.normal((batch, heads, length, cached), key=mx.random.key(3))
    return {
        "none": None,
        "causal": "causal",
        "bool broadcast over heads": mx.broadcast_to(allowed, (batch, 1, length, cached)),
        "additive per head": additive,
    }


@pytest.mark.parametrize(
    "heads, kv_heads, cores",
    [(14, 2, 2), (8, 4, 3), (9, 3, 2), (4, 1, 2), (6, 6, 4), (4, 2, 8)],
    ids=[
        "gqa",
        "gqa-uneven-cores",
        "three-kv-heads-two-cores",
        "one-kv-head",
        "mha",
        "more-cores-than-heads",
    ],
)
def test_split_attention_is_bit_identical_to_mlx_lm(on_cpu, heads, kv_heads, cores):
    batch, length, cached = 2, 128, 1100
    assert batch * heads * length * cached >= MIN_SCORES
    split = HeadParallelAttention(base.scaled_dot_product_attention, cores)
    queries, keys, values = attention_inputs(batch, heads, kv_heads, length, cached)
    assert split.groups(queries, keys, None) > 1
    for name, mask in masks(batch, heads, length, cached).items():
        for sinks in (None, mx.random.normal((heads,), key=mx.random.key(5))):
            expected = base.scaled_dot_product_attention(
                queries, keys, values, None, scale=0.25, mask=mask, sinks=sinks
            )
            got = split(queries, keys, values, None, scale=0.25, mask=mask, sinks=sinks)
            assert got.shape == expected.shape
            assert mx.array_equal(got, expected).item(), (name, sinks is not None)


def test_small_calls_one_core_and_quantized_caches_are_not_split(on_cpu):
    split = HeadParallelAttention(base.scaled_dot_product_attention, cores=2)
    decode = attention_inputs(1, 14, 2, 1, 8700)  # one token over a long cache
    assert split.groups(decode[0], decode[1], None) == 1
    chunk = attention_inputs(1, 14, 2, 512, 8700)
    assert split.groups(chunk[0], chunk[1], None) == 2

    class Quantized:
        bits = 8

    assert split.groups(chunk[0], chunk[1], Quantized()) == 1
    one_core = HeadParallelAttention(base.scaled_dot_product_attention, cores=1)
    assert one_core.groups(chunk[0], chunk[1], None) == 1


@contextmanager
def plain_attention(layer):
    """Within it, `layer`'s architecture calls mlx-lm's own attention (the reference)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            f"{type(layer).__module__}.scaled_dot_product_attention",
            base.scaled_dot_product_attention,
        )
        yield


def test_engines_with_split_attention_decode_exactly_as_plain_mlx_lm(
    on_cpu, tiny_model_dir, monkeypatch
):
    """A 700-token prompt on the tiny model (4 heads, 2 key/value heads) splits its
    prefill's attention; the single and batched engines' greedy tokens equal plain
    mlx-lm's with mlx-lm's own attention."""
    registry = ModelRegistry.load(str(tiny_model_dir))
    model = registry.target.model
    split = cpu_attention.install(model, cores=2)
    assert isinstance(split, HeadParallelAttention)
    layer = model.model.layers[0].self_attn
    assert cpu_attention.attention_of(layer) is split
    prompt = registry.tokenizer.encode("Once upon a time a little robot " * 120)[:700]
    assert 1 * 4 * len(prompt) * len(prompt) >= MIN_SCORES

    with plain_attention(layer):
        expected = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=24)]

    calls = []
    original_groups = split.groups
    monkeypatch.setattr(split, "groups", lambda *a: calls.append(g := original_groups(*a)) or g)
    engine = SpeculativeEngine(registry, SpecConfig(prefill_step_size=1024), cost=COST)
    registry.transfer(engine.name)
    seq = make_sequence(greedy_request("r", prompt, 24), registry.tokenizer)
    engine.admit(seq)
    while engine.active is not None:
        engine.step()
    assert seq.generated == expected
    assert max(calls) == 2, "the prefill's attention was split"


def test_batched_rows_with_split_attention_equal_solo_decoding(on_cpu, tiny_model_dir, reference):
    _, engine = make_engines(tiny_model_dir)
    model = engine.registry.target.model
    split = cpu_attention.install(model, cores=2)
    assert isinstance(split, HeadParallelAttention)
    tokenizer = reference.tokenizer
    long = tokenizer.encode("def add(a, b):\n    return a + b\n" * 60)[:700]
    short = tokenizer.encode("Once upon a time")
    layer = model.model.layers[0].self_attn
    with plain_attention(layer):
        expected = {
            "long": reference.greedy_tokens(long, 20),
            "short": reference.greedy_tokens(short, 30),
        }
    requests = [greedy_request("long", long, 20), greedy_request("short", short, 30)]
    seqs, _, _ = run_batch(engine, requests)
    assert {rid: seq.generated for rid, seq in seqs.items()} == expected
