"""Attention on a CPU device on every core, bit-identical to MLX's.

MLX runs each CPU op on one thread, the thread of its stream; only matrix products
(BLAS) use every core. Attention's softmax, scaling and causal mask are elementwise
over heads x query tokens x cached tokens, so a long prompt's prefill spends most of
its time on one core: on the 2-core CPU box a 512-token chunk at 8.7k tokens of
context took 56 s on Qwen2.5-Coder-0.5B (float32, OpenBLAS), nearly all of it in
attention, where its projections and MLP take about 9 s.

So on a CPU device an attention call that is big enough runs one of two ways:
- float32 without sinks, where the compiled softmax is built and matches MLX's bits
  (`cpu_softmax.py`): MLX's own attention ops with that softmax, which runs on every
  core and ~15x faster than MLX's one value at a time;
- otherwise split into groups of heads, each group's attention computed on its own
  stream (its own thread), and the outputs concatenated along the head axis. MLX's
  maintainers point to streams for exactly this ("op-level multi-threading",
  ml-explore/mlx#2185).
Either way each head's output comes from the same arithmetic on the same values, so
the result is bit-identical (`tests/test_cpu_attention.py`); greedy decoding stays
token-identical to mlx-lm's.

mlx-lm's model modules call `scaled_dot_product_attention` from `mlx_lm.models.base`
by the name they imported, and mlx-lm has no hook for it, so `install` rebinds that
name in the loaded model's own modules (process-wide: every model of that
architecture in the process then uses it; off a CPU device it passes straight to
mlx-lm's). Streams are per thread (MLX's are thread-local): each thread that runs a
model makes its own on first use.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

from engines.platform import cpu_softmax
from engines.platform.cpu_softmax import SoftmaxKernel

log = logging.getLogger(__name__)

# Scores below this many (batch x heads x query tokens x cached tokens) stay on one
# stream: a decode step's attention is small beside its matrix products, and each
# extra stream costs a cross-stream wait.
MIN_SCORES = 1 << 20
# The compiled softmax pays off from far fewer scores (its cost: one evaluation and
# one call): measured on the 2-core box, 14 heads x 1 query over 8.7k cached tokens
# (a decode step) 6.4 -> 4.4 ms; 14 x 1 x 512, 0.64 -> 0.71 ms.
KERNEL_MIN_SCORES = 1 << 15


def usable_cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def bounds(count: int, groups: int) -> list[int]:
    """Where `count` heads split into `groups` runs as even as can be (3 into 2: 2 + 1)."""
    return [round(i * count / groups) for i in range(groups + 1)]


class CpuAttention:
    """mlx-lm's `scaled_dot_product_attention` on every CPU core (see the module)."""

    def __init__(self, original: Any, cores: int, kernel: SoftmaxKernel | None = None) -> None:
        self.original = original  # mlx-lm's own function, for everything not split
        self.cores = cores
        self.kernel = kernel  # the compiled softmax; None: heads split across streams
        self._local = threading.local()  # .streams: this thread's CPU streams

    def __call__(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: mx.array | None = None,
    ) -> mx.array:
        if _cpu_scores(queries, keys, cache) < min(KERNEL_MIN_SCORES, MIN_SCORES):
            # a decode step's or a short verify's attention, too small for either way:
            # mlx-lm's own after one check (a step calls this once per layer)
            return self.original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        if self.uses_kernel(queries, keys, cache, mask, sinks):
            return cpu_softmax.attention(self.kernel, queries, keys, values, scale, mask)
        groups = self.groups(queries, keys, cache)
        if groups <= 1:
            return self.original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        heads, kv_heads = queries.shape[1], keys.shape[1]
        per_kv = heads // kv_heads  # query heads that share one key/value head
        # whole key/value heads per group, each with its query heads; with one shared
        # key/value head, groups of query heads
        edges = bounds(kv_heads if kv_heads > 1 else heads, groups)
        parts = []
        for stream, start, end in zip(self._streams(groups), edges[:-1], edges[1:], strict=True):
            if kv_heads > 1:
                q_heads, kv = slice(start * per_kv, end * per_kv), slice(start, end)
            else:
                q_heads, kv = slice(start, end), slice(None)
            parts.append(
                mx.fast.scaled_dot_product_attention(
                    queries[:, q_heads],
                    keys[:, kv],
                    values[:, kv],
                    scale=scale,
                    mask=_heads_of(mask, q_heads),
                    sinks=None if sinks is None else sinks[q_heads],
                    stream=stream,
                )
            )
        return mx.concatenate(parts, axis=1)

    def groups(self, queries: mx.array, keys: mx.array, cache: Any) -> int:
        """How many groups of heads this call splits into (1: not split)."""
        if self.cores <= 1 or _cpu_scores(queries, keys, cache) < MIN_SCORES:
            return 1
        heads, kv_heads = queries.shape[1], keys.shape[1]
        return min(self.cores, kv_heads if kv_heads > 1 else heads)

    def uses_kernel(
        self, queries: mx.array, keys: mx.array, cache: Any, mask: Any, sinks: Any
    ) -> bool:
        """Whether the compiled softmax takes this call: float32 without sinks on a CPU
        device, unquantized, and big enough."""
        if self.kernel is None or sinks is not None:
            return False
        if queries.dtype != mx.float32 or keys.dtype != mx.float32:
            return False
        if _cpu_scores(queries, keys, cache) < KERNEL_MIN_SCORES:
            return False
        # a causal chunk longer than its cache is no prompt's; MLX's mask has it
        return not (isinstance(mask, str) and keys.shape[2] < queries.shape[2])

    def _streams(self, count: int) -> list:
        streams = getattr(self._local, "streams", [])
        while len(streams) < count:
            streams.append(mx.new_stream(mx.cpu))
        self._local.streams = streams
        return streams[:count]


def _cpu_scores(queries: mx.array, keys: mx.array, cache: Any) -> int:
    """The call's scores (batch x heads x query tokens x cached tokens) where either way
    may take it: a CPU device, an unquantized cache, whole query heads per key/value
    head; 0 elsewhere."""
    if mx.default_device() != mx.cpu or hasattr(cache, "bits"):
        return 0
    batch, heads, length, _ = queries.shape
    kv_heads, cached = keys.shape[1], keys.shape[2]
    return 0 if heads % kv_heads else batch * heads * length * cached


def _heads_of(mask: Any, heads: slice) -> Any:
    """The mask for a group of query heads: an array with a head axis is sliced;
    None, "causal" and masks broadcast over heads apply to every group as they are."""
    if isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[1] > 1:
        return mask[:, heads]
    return mask


def install(model: Any, cores: int | None = None) -> CpuAttention | None:
    """Make `model`'s architecture use `CpuAttention` (see the module docstring);
    returns the function now in use, None where there is nothing to replace (an
    architecture with its own attention, or one core and no compiled softmax)."""
    cores = usable_cores() if cores is None else cores
    installed = None
    for module in {type(layer).__module__ for layer in model.modules()}:
        namespace = sys.modules.get(module)
        current = getattr(namespace, "scaled_dot_product_attention", None)
        if current is base.scaled_dot_product_attention:
            kernel = SoftmaxKernel.load(cores) if mx.default_device() == mx.cpu else None
            if kernel is None and cores <= 1:
                continue  # one core and MLX's softmax: nothing to gain
            current = CpuAttention(base.scaled_dot_product_attention, cores, kernel)
            namespace.scaled_dot_product_attention = current
            way = "MLX's softmax compiled" if kernel else "heads split across streams"
            log.info("CPU attention for %s: %s, %d cores", module, way, cores)
        if isinstance(current, CpuAttention):
            installed = current
    return installed


def attention_of(layer: Any) -> Any:
    """The attention function `layer`'s own module calls (head-parallel once installed)."""
    namespace = sys.modules.get(type(layer).__module__)
    return getattr(namespace, "scaled_dot_product_attention", base.scaled_dot_product_attention)
