"""Attention on every CPU core (the compiled softmax, or heads split across streams):
bit-identical to mlx-lm's attention, for every mask, head layout and sink MLX takes,
and greedy decoding through the engines stays token-identical to plain mlx-lm."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import base

from engines import platform
from engines.model.registry import ModelRegistry
from engines.platform import cpu_attention
from engines.platform.cpu_attention import MIN_SCORES, CpuAttention
from engines.platform.cpu_softmax import NO_MASK, SoftmaxKernel, mlx_softmax
from engines.sequence import make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
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


@pytest.fixture(scope="module")
def kernel():
    """The compiled softmax; it is built by the install, and on Linux x86_64 (CI, this
    box) it must match MLX's bits, else the fast path silently went missing."""
    loaded = SoftmaxKernel.load(threads=2)
    assert loaded is not None, "the compiled CPU softmax did not build or does not match MLX"
    return loaded


def counted_softmaxes(monkeypatch, kernel: SoftmaxKernel) -> list[int]:
    """The query tokens of each call `kernel` runs from now on (it still runs them)."""
    calls: list[int] = []
    real_softmax = kernel.softmax_

    def counted(scores, query_len, offset):
        calls.append(query_len)
        real_softmax(scores, query_len, offset)

    monkeypatch.setattr(kernel, "softmax_", counted)
    return calls


@pytest.mark.parametrize("way", ["compiled softmax", "heads split"])
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
def test_cpu_attention_is_bit_identical_to_mlx_lm(
    on_cpu, kernel, monkeypatch, way, heads, kv_heads, cores
):
    batch, length, cached = 2, 128, 1100
    assert batch * heads * length * cached >= MIN_SCORES
    chosen = kernel if way == "compiled softmax" else None
    split = CpuAttention(base.scaled_dot_product_attention, cores, chosen)
    softmaxes = counted_softmaxes(monkeypatch, kernel)
    queries, keys, values = attention_inputs(batch, heads, kv_heads, length, cached)
    assert split.groups(queries, keys, None) > 1
    for name, mask in masks(batch, heads, length, cached).items():
        for sinks in (None, mx.random.normal((heads,), key=mx.random.key(5))):
            expected = base.scaled_dot_product_attention(
                queries, keys, values, None, scale=0.25, mask=mask, sinks=sinks
            )
            softmaxes.clear()
            got = split(queries, keys, values, None, scale=0.25, mask=mask, sinks=sinks)
            assert got.shape == expected.shape
            assert mx.array_equal(got, expected).item(), (name, sinks is not None)
            # the compiled softmax ran where it should (float32, no sinks), nowhere else
            assert len(softmaxes) == (chosen is not None and sinks is None), name


SPECIAL = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    -0.5,
    88.0,
    -88.0,
    88.5,
    -88.5,
    87.9,
    -87.9,
    200.0,
    -200.0,
    1e-30,
    -1e-30,
    3.4e38,
    -3.4e38,
    0.34657359,
    -0.34657359,
    0.49999997,
]


@pytest.mark.parametrize("cached", [1, 7, 8, 9, 15, 16, 17, 63, 255, 1029])
def test_compiled_softmax_matches_mlx_bit_for_bit(kernel, cached):
    """Every row length modulo the vector width, masked and not, over ordinary scores and
    the edges of MLX's exp: its cut-offs at +-88, halves that its `floor(x + 0.5)`
    rounds in double (0.49999997 rounds up in float), huge, tiny, zeros of either sign,
    infinities and NaN, and equal maxima."""
    length = 6
    rng = np.random.default_rng(cached)
    base_rows = rng.standard_normal((2, length, cached)).astype(np.float32) * 9
    special = np.resize(np.array(SPECIAL, np.float32), (2, length, cached))
    with_specials = np.where(rng.random((2, length, cached)) < 0.3, special, base_rows)
    with_specials[0, 0, :] = 88.0  # a row of equal maxima
    with_specials[1, 1, 0] = np.inf
    with_specials[1, 2, -1] = np.nan
    with_specials[1, 3, :] = -np.inf
    for values in (base_rows, with_specials):
        for offset in (NO_MASK, max(cached - length, 0), cached):
            ours = mx.array(values)
            mx.eval(ours)
            kernel.softmax_(ours, length, offset)
            expected = mlx_softmax(mx.array(values), offset)
            assert mx.array_equal(ours, expected, equal_nan=True).item(), (
                offset,
                values is base_rows,
            )


def test_the_compiled_softmax_is_refused_where_it_differs_from_mlx(kernel):
    """The check before use catches a kernel whose bits differ from MLX's (here: by
    one ulp, as a port of MLX's exp that rounds `x + 0.5` in float sometimes is)."""

    class FloatRounding:
        @staticmethod
        def softmax(view, cols, length, offset, threads):
            kernel.module.softmax(view, cols, length, offset, threads)
            scores = np.frombuffer(view, np.float32)
            scores[:] = np.nextafter(scores, np.float32(1))  # one ulp off

    assert kernel.matches_mlx()
    assert not SoftmaxKernel(FloatRounding(), threads=2).matches_mlx()


def test_small_calls_one_core_and_quantized_caches_are_not_split(on_cpu):
    split = CpuAttention(base.scaled_dot_product_attention, cores=2)
    decode = attention_inputs(1, 14, 2, 1, 8700)  # one token over a long cache
    assert split.groups(decode[0], decode[1], None) == 1
    chunk = attention_inputs(1, 14, 2, 512, 8700)
    assert split.groups(chunk[0], chunk[1], None) == 2

    class Quantized:
        bits = 8

    assert split.groups(chunk[0], chunk[1], Quantized()) == 1
    one_core = CpuAttention(base.scaled_dot_product_attention, cores=1)
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


@pytest.mark.parametrize("way", ["compiled softmax", "heads split"])
def test_engines_with_cpu_attention_decode_exactly_as_plain_mlx_lm(
    on_cpu, tiny_model_dir, monkeypatch, way
):
    """A 700-token prompt on the tiny model (4 heads, 2 key/value heads) runs its
    prefill's attention through the compiled softmax, or split by heads where that is
    not built; the single engine's greedy tokens equal plain mlx-lm's with mlx-lm's own
    attention."""
    registry = ModelRegistry.load(str(tiny_model_dir))
    model = registry.target.model
    split = cpu_attention.install(model, cores=2)
    assert isinstance(split, CpuAttention)
    layer = model.model.layers[0].self_attn
    assert cpu_attention.attention_of(layer) is split
    prompt = registry.tokenizer.encode("Once upon a time a little robot " * 120)[:700]
    assert 1 * 4 * len(prompt) * len(prompt) >= MIN_SCORES

    with plain_attention(layer):
        expected = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=24)]

    calls = []
    original_groups = split.groups
    monkeypatch.setattr(split, "groups", lambda *a: calls.append(g := original_groups(*a)) or g)
    assert split.kernel is not None, "installed with the compiled softmax"
    softmaxes = counted_softmaxes(monkeypatch, split.kernel)
    if way == "heads split":
        monkeypatch.setattr(split, "kernel", None)
    engine = SpeculativeEngine(registry, SpecConfig(prefill_step_size=1024), cost=COST)
    registry.transfer(engine.name)
    seq = make_sequence(greedy_request("r", prompt, 24), registry.tokenizer)
    engine.admit(seq)
    while engine.active is not None:
        engine.step()
    assert seq.generated == expected
    if way == "heads split":
        assert max(calls) == 2, "the prefill's attention was split"
        assert not softmaxes
    else:
        # every prefill chunk's softmax (query tokens per call) was the compiled one
        assert sum(softmaxes) >= len(prompt) - 1, softmaxes


def test_batched_rows_with_cpu_attention_equal_solo_decoding(
    on_cpu, tiny_model_dir, reference, monkeypatch
):
    _, engine = make_engines(tiny_model_dir)
    model = engine.registry.target.model
    split = cpu_attention.install(model, cores=2)
    assert isinstance(split, CpuAttention)
    tokenizer = reference.tokenizer
    long = tokenizer.encode("def add(a, b):\n    return a + b\n" * 60)[:700]
    short = tokenizer.encode("Once upon a time")
    layer = model.model.layers[0].self_attn
    with plain_attention(layer):
        expected = {
            "long": reference.greedy_tokens(long, 20),
            "short": reference.greedy_tokens(short, 30),
        }
    softmaxes = counted_softmaxes(monkeypatch, split.kernel)
    requests = [greedy_request("long", long, 20), greedy_request("short", short, 30)]
    seqs, _, _ = run_batch(engine, requests)
    assert {rid: seq.generated for rid, seq in seqs.items()} == expected
    assert softmaxes, "the long row's prefill went through the compiled softmax"


def test_without_the_compiled_softmax_attention_splits_heads(on_cpu, monkeypatch):
    """Where the extension did not build (no C compiler), loading gives no kernel and
    the attention falls back to heads split across streams, still bit-identical."""
    monkeypatch.setitem(sys.modules, "engines.platform._cpu_softmax", None)  # import fails
    monkeypatch.delattr(platform, "_cpu_softmax", raising=False)
    assert SoftmaxKernel.load(threads=2) is None
    attention = CpuAttention(base.scaled_dot_product_attention, 2, SoftmaxKernel.load(2))
    queries, keys, values = attention_inputs(1, 14, 2, 128, 1100)
    assert not attention.uses_kernel(queries, keys, None, "causal", None)
    assert attention.groups(queries, keys, None) == 2
    expected = base.scaled_dot_product_attention(
        queries, keys, values, None, scale=0.25, mask="causal"
    )
    got = attention(queries, keys, values, None, scale=0.25, mask="causal")
    assert mx.array_equal(got, expected).item()


def test_a_compiled_softmax_that_cannot_run_here_is_not_loaded(monkeypatch):
    """An extension that raises where it would write (say, MLX's buffers turned
    read-only) leaves the model loading, with MLX's softmax."""

    class ReadOnly:
        @staticmethod
        def softmax(view, cols, length, offset, threads):
            raise TypeError("argument 1 must be read-write bytes-like object")

    monkeypatch.setitem(sys.modules, "engines.platform._cpu_softmax", ReadOnly)
    monkeypatch.setattr(platform, "_cpu_softmax", ReadOnly, raising=False)
    assert SoftmaxKernel.load(threads=2) is None


def test_one_core_still_gets_the_compiled_softmax(on_cpu, tiny_model_dir):
    """Its exp is vectorized as well as spread: one core gains too, so a 1-core
    box installs it (and nothing where the extension is missing: no split to make)."""
    registry = ModelRegistry.load(str(tiny_model_dir))
    layer = registry.target.model.model.layers[0].self_attn
    with plain_attention(layer):
        installed = cpu_attention.install(registry.target.model, cores=1)
        assert isinstance(installed, CpuAttention) and installed.kernel is not None
        assert installed.kernel.threads == 1
        queries, keys, values = attention_inputs(1, 4, 2, 64, 600)
        assert installed.uses_kernel(queries, keys, None, "causal", None)
        assert installed.groups(queries, keys, None) == 1
        expected = base.scaled_dot_product_attention(
            queries, keys, values, None, scale=0.25, mask="causal"
        )
        got = installed(queries, keys, values, None, scale=0.25, mask="causal")
        assert mx.array_equal(got, expected).item()
