"""Prometheus metrics with vLLM's names, so `vllm bench serve` and existing
dashboards work unchanged, plus Tandem's own under `tandem_`.

`Metrics` is the scheduler's observer: it is called on the engine thread when a
request sees its first token, between tokens, when it finishes, on mode switches
and batched steps. Gauges (running, waiting, mode, memory) are read at scrape time.
Each app has its own `CollectorRegistry`: no module-level metric state.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from engines.telemetry import SpecStats
from scheduler.observer import RequestRecord
from scheduler.policy import Mode
from server.live_metrics import METHODS, LiveGauges
from server.server_tools import KNOWN_KINDS

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
SWITCH_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
DRAFT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
FINISH_REASONS = ("stop", "length", "cancelled", "error")
GATES = ("prompt", "runtime")
SKIPPED_TOOL_SURFACES = ("messages", "responses")
RECENT_REQUESTS = 64  # finished requests kept for the web page (GET /ui/status)


class Metrics:
    def __init__(self, model_name: str, scheduler, blas: str) -> None:
        self.model_name = model_name
        self.scheduler = scheduler
        self.blas = blas
        self.started = time.time()
        self.registry = CollectorRegistry()
        self.totals = SpecStats()  # for /v1/stats
        self.finished: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.disconnects = 0
        # The last finished requests (appended on the engine thread; readers copy it).
        self.recent: deque[RequestRecord] = deque(maxlen=RECENT_REQUESTS)
        self.skipped_tool_counts: dict[str, int] = {}  # event loop; shown in /v1/stats
        self._build()
        self.registry.register(LiveGauges(model_name, scheduler, blas))

    def _build(self) -> None:
        labels, reg = ["model_name"], self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=reg)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        self.drafts = counter("vllm:spec_decode_num_drafts", "Verify steps with a draft.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens.")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Accepted drafts.")
        self.accepted_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafted tokens by position in the draft.",
            ("position",),
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.success = counter(
            "vllm:request_success", "Finished requests by reason.", ("finished_reason",)
        )
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens served from cache.")
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between token emissions.", ITL_BUCKETS
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Request latency.", E2E_BUCKETS)
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Time waiting before service.", E2E_BUCKETS
        )
        self.request_prompt = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS
        )
        self.request_generation = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self.method_drafted = counter(
            "tandem_spec_draft_tokens", "Drafted tokens by method.", ("method",)
        )
        self.method_accepted = counter(
            "tandem_spec_accepted_tokens", "Accepted drafted tokens by method.", ("method",)
        )
        self.gate_trips = counter(
            "tandem_spec_gate_trips", "Times a gate switched drafting off.", ("gate",)
        )
        self.mode_switches = counter(
            "tandem_mode_switches", "Engine mode switches.", ("from", "to")
        )
        self.switch_seconds = histogram(
            "tandem_mode_switch_seconds", "Time to switch engines (migration).", SWITCH_BUCKETS
        )
        self.batch_size = histogram(
            "tandem_batch_size", "Sequences per batched step.", BATCH_BUCKETS
        )
        self.spec_row_drafts = histogram(
            "tandem_spec_draft_tokens_per_row",
            "Tokens each row drafted in a batched step (0 = it only decoded).",
            DRAFT_BUCKETS,
        )
        self.spec_batch_size = histogram(
            "tandem_spec_batch_size",
            "Sequences per batched step in which at least one row drafted.",
            BATCH_BUCKETS,
        )
        self.step_model = histogram(
            "tandem_step_model_seconds",
            "Batched step time in model forwards (until their results are read).",
            STEP_BUCKETS,
        )
        self.step_overhead = histogram(
            "tandem_step_overhead_seconds",
            "Batched step time outside model forwards: planning, commit, detokenize, publish.",
            STEP_BUCKETS,
        )
        self.request_errors = counter(
            "tandem_request_errors", "Requests refused or failed, by kind.", ("kind",)
        )
        self.client_disconnects = counter(
            "tandem_client_disconnects", "Requests cancelled because the client left."
        )
        self.skipped_tools = counter(
            "tandem_server_tools_not_offered",
            "Server-executed tools (web search, code execution, ...) a request listed that "
            "Tandem cannot run and did not offer the model, by API surface and kind.",
            ("surface", "kind"),
        )
        self.images_omitted = counter(
            "tandem_images_omitted",
            "Images sent to a model that reads text only (it reads a placeholder), by API surface.",
            ("surface",),
        )
        # Pre-create the bounded label sets so they export zeros from the start.
        m = self.model_name
        for reason in FINISH_REASONS:
            self.success.labels(m, reason)
        for method in METHODS:
            self.method_drafted.labels(m, method)
            self.method_accepted.labels(m, method)
        for gate in GATES:
            self.gate_trips.labels(m, gate)
        for surface in ("chat", "messages", "responses"):
            self.images_omitted.labels(m, surface)
        for surface in SKIPPED_TOOL_SURFACES:
            for kind in (*KNOWN_KINDS, "other"):
                self.skipped_tools.labels(m, surface, kind)
        for position in range(self.scheduler.max_draft_tokens):
            self.accepted_per_pos.labels(m, str(position))
        for mode in Mode:
            for other in Mode:
                if other != mode:
                    self.mode_switches.labels(m, mode.value, other.value)
        for name in (
            "drafts",
            "draft_tokens",
            "accepted",
            "prompt_tokens",
            "generation_tokens",
            "prefix_queries",
            "prefix_hits",
            "client_disconnects",
        ):
            getattr(self, name).labels(m)

    # ---- SchedulerObserver (engine thread) ----------------------------------------

    def on_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def on_token_gap(self, seconds: float) -> None:
        self.itl.labels(self.model_name).observe(seconds)

    def on_finished(self, record: RequestRecord) -> None:
        m = self.model_name
        self.success.labels(m, record.finish_reason).inc()
        self.finished[record.finish_reason] = self.finished.get(record.finish_reason, 0) + 1
        self.recent.append(record)
        self.prompt_tokens.labels(m).inc(record.prompt_tokens)
        self.generation_tokens.labels(m).inc(record.completion_tokens)
        self.prefix_queries.labels(m).inc(record.prompt_tokens)
        self.prefix_hits.labels(m).inc(record.cached_tokens)
        self.e2e.labels(m).observe(record.e2e_s)
        if record.queue_s is not None:
            self.queue.labels(m).observe(record.queue_s)
        self.request_prompt.labels(m).observe(record.prompt_tokens)
        self.request_generation.labels(m).observe(record.completion_tokens)
        self._record_speculation(record.speculation)

    def _record_speculation(self, spec: SpecStats) -> None:
        m = self.model_name
        self.totals.merge(spec)
        self.drafts.labels(m).inc(spec.drafts)
        self.draft_tokens.labels(m).inc(spec.draft_tokens)
        self.accepted.labels(m).inc(spec.accepted_tokens)
        for position, count in enumerate(spec.accepted_per_position):
            self.accepted_per_pos.labels(m, str(position)).inc(count)
        for method, stats in spec.by_method.items():
            self.method_drafted.labels(m, method).inc(stats.draft_tokens)
            self.method_accepted.labels(m, method).inc(stats.accepted_tokens)
        for gate, count in spec.gate_trips.items():
            self.gate_trips.labels(m, gate).inc(count)

    def on_mode_switch(self, source: str, target: str, seconds: float) -> None:
        self.mode_switches.labels(self.model_name, source, target).inc()
        self.switch_seconds.labels(self.model_name).observe(seconds)

    def on_batch_step(self, size: int) -> None:
        self.batch_size.labels(self.model_name).observe(size)

    def on_speculation_step(self, size: int, drafted: list[int]) -> None:
        rows = self.spec_row_drafts.labels(self.model_name)
        for count in drafted:
            rows.observe(count)
        if any(drafted):
            self.spec_batch_size.labels(self.model_name).observe(size)

    def on_step_time(self, model_s: float, overhead_s: float) -> None:
        self.step_model.labels(self.model_name).observe(model_s)
        self.step_overhead.labels(self.model_name).observe(max(0.0, overhead_s))

    # ---- server side (event loop) -------------------------------------------------

    def count_error(self, kind: str) -> None:
        self.request_errors.labels(self.model_name, kind).inc()
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def count_skipped_tool(self, surface: str, kind: str) -> None:
        self.skipped_tools.labels(self.model_name, surface, kind).inc()
        key = f"{surface}:{kind}"
        self.skipped_tool_counts[key] = self.skipped_tool_counts.get(key, 0) + 1

    def count_omitted_images(self, surface: str, count: int) -> None:
        self.images_omitted.labels(self.model_name, surface).inc(count)

    def count_disconnect(self) -> None:
        self.client_disconnects.labels(self.model_name).inc()
        self.disconnects += 1

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def stats(self) -> dict:
        """The JSON of GET /v1/stats."""
        spec = self.totals
        by_method = {
            method: {
                "drafts": s.drafts,
                "draft_tokens": s.draft_tokens,
                "accepted_tokens": s.accepted_tokens,
                "acceptance_rate": _ratio(s.accepted_tokens, s.draft_tokens),
                "mean_accepted_length": _ratio(s.accepted_tokens, s.drafts),
            }
            for method, s in sorted(spec.by_method.items())
        }
        scheduler = self.scheduler
        return {
            "model": self.model_name,
            "mode": scheduler.mode.value,
            "uptime_s": round(time.time() - self.started, 3),
            "blas": self.blas,
            "requests": {
                "running": scheduler.num_running,
                "waiting": scheduler.num_waiting,
                "finished": dict(self.finished),
                "errors": dict(self.errors),
                "client_disconnects": self.disconnects,
                "server_tools_not_offered": dict(self.skipped_tool_counts),
            },
            "speculation": {
                "drafters": scheduler.drafters,
                "draft_vocabulary": scheduler.draft_vocabulary,
                "drafts": spec.drafts,
                "draft_tokens": spec.draft_tokens,
                "accepted_tokens": spec.accepted_tokens,
                "acceptance_rate": _ratio(spec.accepted_tokens, spec.draft_tokens),
                "mean_acceptance_length": 1 + _ratio(spec.accepted_tokens, spec.drafts),
                "acceptance_rate_per_position": [
                    _ratio(count, spec.drafts) for count in spec.accepted_per_position
                ],
                "by_method": by_method,
                "gate_trips": dict(spec.gate_trips),
                "costs": scheduler.speculation_costs,
                "suffix_index": scheduler.suffix.stats(),
            },
            "mode_switches": {
                f"{a}->{b}": n for (a, b), n in sorted(scheduler.counters.mode_switches.items())
            },
            "migrated_requests": scheduler.counters.migrated_requests,
            "prefill_follows": dict(scheduler.counters.prefill_follows),
            "batch_sizes": {str(k): v for k, v in sorted(scheduler.counters.batch_sizes.items())},
            "batched_engine_started": scheduler.batched_engine is not None,
            "memory_bytes": dict(scheduler.memory),
            "kv_budget": scheduler.kv_stats,
            "prefix_cache": scheduler.prefix_stats,
            "measured_rates": dict(scheduler.measured_rates),
        }


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0
