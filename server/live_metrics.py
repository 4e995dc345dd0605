"""The gauges `/metrics` reads from the scheduler at scrape time (running, waiting,
mode, memory, drafters, suffix indexes, KV budget, prefix cache tiers, cost beliefs),
beside `server.metrics`' counters and histograms, which the scheduler's observer
calls update as requests run.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from scheduler.policy import Mode

METHODS = ("draft", "mtp", "pld", "suffix")
SUFFIX_KINDS = ("keys", "sequences", "tokens", "bytes")  # tandem_suffix_index, over keys
MEMORY_KINDS = ("active", "cache", "peak")


class LiveGauges(Collector):
    """Gauges read from the scheduler at scrape time."""

    def __init__(self, model_name: str, scheduler, blas: str) -> None:
        self.model_name, self.scheduler, self.blas = model_name, scheduler, blas

    def collect(self) -> Iterator[GaugeMetricFamily]:
        m, scheduler = self.model_name, self.scheduler
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests being decoded.", labels=["model_name"]
        )
        running.add_metric([m], scheduler.num_running)
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting for a slot.", labels=["model_name"]
        )
        waiting.add_metric([m], scheduler.num_waiting)
        mode = GaugeMetricFamily(
            "tandem_engine_mode",
            "1 for the engine that owns the model.",
            labels=["model_name", "mode"],
        )
        for candidate in Mode:
            mode.add_metric([m, candidate.value], 1.0 if scheduler.mode == candidate else 0.0)
        memory = GaugeMetricFamily(
            "tandem_memory_bytes", "MLX memory.", labels=["model_name", "kind"]
        )
        for kind in MEMORY_KINDS:
            memory.add_metric([m, kind], scheduler.memory.get(kind, 0))
        for kind, size in _kv_sizes(scheduler.kv_stats).items():
            memory.add_metric([m, kind], size)
        blas = GaugeMetricFamily(
            "tandem_blas_info", "The BLAS MLX uses (1).", labels=["model_name", "library"]
        )
        blas.add_metric([m, self.blas], 1.0)
        supported = GaugeMetricFamily(
            "tandem_speculation_supported",
            "1 when the model's KV caches roll back, so drafting can run; 0 serves it plainly.",
            labels=["model_name"],
        )
        supported.add_metric([m], 1.0 if scheduler.speculation_supported else 0.0)
        drafters = GaugeMetricFamily(
            "tandem_drafter_active",
            "1 for each drafter requests may use: pld (prompt lookup), suffix (the API key's "
            "recent requests), draft (--draft-model), mtp (the model's own "
            "multi-token-prediction head).",
            labels=["model_name", "drafter"],
        )
        active = scheduler.drafters
        for drafter in METHODS:
            drafters.add_metric([m, drafter], 1.0 if drafter in active else 0.0)
        ranks = GaugeMetricFamily(
            "tandem_ranks",
            "Processes the model is sharded over (--distributed under mlx.launch); 1 = one.",
            labels=["model_name"],
        )
        ranks.add_metric([m], scheduler.ranks)
        yield from (running, waiting, mode, memory, blas, supported, drafters, ranks)
        yield from _suffix_metrics(m, scheduler.suffix.stats())
        yield from _kv_metrics(m, scheduler.kv_stats)
        yield from _prefix_metrics(m, scheduler.prefix_stats)
        yield from _follow_metrics(m, dict(scheduler.counters.prefill_follows))
        yield from self._cost_gauges(m, scheduler.speculation_costs)

    @staticmethod
    def _cost_gauges(m: str, costs: dict | None) -> Iterator[GaugeMetricFamily]:
        if costs is None:
            return
        verify = GaugeMetricFamily(
            "tandem_spec_verify_cost_ratio",
            "Cost of a target forward over n tokens / a plain decode step, as the drafting "
            "gates currently believe it (start-up measurement, corrected by real steps).",
            labels=["model_name", "tokens"],
        )
        for n, cost in enumerate(costs["verify"], start=1):
            verify.add_metric([m, str(n)], cost)
        draft = GaugeMetricFamily(
            "tandem_spec_draft_step_cost_ratio",
            "Cost of one draft-model token / a plain target decode step (0 without a draft).",
            labels=["model_name"],
        )
        draft.add_metric([m], costs["draft_step"])
        yield from (verify, draft)


def _suffix_metrics(m: str, stats: dict[str, int]) -> Iterator:
    """The suffix decoding indexes' size (bounded: --suffix-tokens-per-key a key, for
    at most --suffix-max-keys keys) and what was evicted to stay within it."""
    size = GaugeMetricFamily(
        "tandem_suffix_index",
        "Suffix decoding indexes, summed over API keys: keys, sequences and tokens held, "
        "and their bytes (estimated from the tokens).",
        labels=["model_name", "kind"],
    )
    for kind in SUFFIX_KINDS:
        size.add_metric([m, kind], stats[kind])
    evicted = CounterMetricFamily(
        "tandem_suffix_evicted_sequences",
        "Sequences evicted from suffix indexes to keep each key within its token bound.",
        labels=["model_name"],
    )
    evicted.add_metric([m], stats["evicted_sequences"])
    yield from (size, evicted)


def _prefix_metrics(m: str, prefix: dict | None) -> Iterator:
    """Prefix-cache lookups served, by tier (memory, disk), and the bytes on disk."""
    hits = CounterMetricFamily(
        "tandem_prefix_cache_hits",
        "Requests started from a prefix-cache entry, by the tier it came from (ram, disk).",
        labels=["model_name", "tier"],
    )
    disk = GaugeMetricFamily(
        "tandem_prefix_cache_disk_bytes",
        "Bytes of prefix-cache entries on disk (--prefix-cache-disk-gb bounds them).",
        labels=["model_name"],
    )
    for tier in ("ram", "disk"):
        hits.add_metric([m, tier], prefix["hits"][tier] if prefix else 0)
    disk.add_metric([m], prefix["disk"]["bytes"] if prefix and prefix["disk"] else 0)
    yield from (hits, disk)


def _follow_metrics(m: str, follows: dict[str, int]) -> Iterator:
    """Requests that waited for another request's prefill of their prefix (same API
    key), by how the wait ended, or started from a copy of its cache while it decoded
    (scheduler/prefill_followers.py)."""
    family = CounterMetricFamily(
        "tandem_prefill_follows",
        "Requests that waited for a prefill of their prefix by another request of their key, "
        "by outcome (served, left, stalled), or started from a copy of its cache (copied).",
        labels=["model_name", "outcome"],
    )
    for outcome in ("served", "left", "stalled", "copied"):
        family.add_metric([m, outcome], follows.get(outcome, 0))
    yield family


def _kv_metrics(m: str, kv: dict | None) -> Iterator:
    """Requests preempted to keep within the KV budget (--max-kv-gb); its bytes are
    kinds of tandem_memory_bytes."""
    if kv is None:
        return
    preemptions = CounterMetricFamily(
        "tandem_kv_preemptions",
        "Running requests preempted to keep KV within the budget (resumed later).",
        labels=["model_name"],
    )
    preemptions.add_metric([m], kv["preemptions"])
    yield preemptions


def _kv_sizes(kv: dict | None) -> dict[str, int]:
    """The KV budget's bytes as memory kinds: the budget, what running requests reserve
    at their reach, what the engines' caches hold (measured), the prefix cache's."""
    kinds = ("budget", "reserved", "measured", "prefix_cache")
    return {f"kv_{kind}": kv[f"{kind}_bytes"] for kind in kinds} if kv else {}
