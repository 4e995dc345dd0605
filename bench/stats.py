"""Per-request latency maths and per-level aggregation for `tandem bench serve`.

Pure functions over `RequestRecord`s, so the numbers can be checked on hand-made
timings. Definitions follow vLLM's `vllm bench serve` (and its key names), so results
from either harness can be read side by side:

- TTFT: request start to the first chunk that carries content.
- ITL: the gap between consecutive content chunks (a chunk may carry several tokens;
  one gap per chunk arrival).
- TPOT: (e2e latency - TTFT) / (output tokens - 1), for requests with > 1 token.
- E2EL: request start to the end of the stream.

Also parses Prometheus text (`/metrics`) into the speculative-decoding figures vLLM
reports: acceptance rate and mean acceptance length from counter deltas.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")

SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
MODE_SWITCHES = "tandem_mode_switches"


@dataclass
class RequestRecord:
    """What one streamed request produced. Times are seconds; `chunk_times` are the
    arrival times of content chunks, relative to the request's start."""

    prompt_index: int
    success: bool = False
    chunk_times: list[float] = field(default_factory=list)
    e2el: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    usage_reported: bool = False
    text: str = ""
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        return inter_token_latencies(self.chunk_times)

    @property
    def tpot(self) -> float | None:
        return time_per_output_token(self.e2el, self.ttft, self.output_tokens)


def inter_token_latencies(chunk_times: Sequence[float]) -> list[float]:
    """One gap per content chunk after the first."""
    return [later - earlier for earlier, later in pairwise(chunk_times)]


def time_per_output_token(e2el: float, ttft: float | None, output_tokens: int) -> float | None:
    """(e2el - ttft) / (tokens - 1): the decode rate, excluding prefill. None when it is
    undefined (no first token, or a single token)."""
    if ttft is None or output_tokens < 2:
        return None
    return (e2el - ttft) / (output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile, the same as `numpy.percentile`'s default."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def std(values: Sequence[float]) -> float:
    """Population standard deviation, as `numpy.std` (and vLLM) computes it."""
    centre = mean(values)
    return math.sqrt(sum((value - centre) ** 2 for value in values) / len(values))


def summarize(name: str, seconds: Sequence[float]) -> dict[str, float | None]:
    """mean_/median_/std_/pNN_ `name`_ms keys; None for all of them when there are no
    values (rather than a misleading 0)."""
    keys = ["mean", "median", "std", *(f"p{q}" for q in PERCENTILES)]
    if not seconds:
        return {f"{key}_{name}_ms": None for key in keys}
    millis = [value * 1000 for value in seconds]
    summary = {
        f"mean_{name}_ms": mean(millis),
        f"median_{name}_ms": percentile(millis, 50),
        f"std_{name}_ms": std(millis),
    }
    summary.update({f"p{q}_{name}_ms": percentile(millis, q) for q in PERCENTILES})
    return summary


def latency_samples(records: Iterable[RequestRecord]) -> dict[str, list[float]]:
    """TTFT, TPOT, flattened ITL and E2EL samples of the successful requests."""
    samples: dict[str, list[float]] = {name: [] for name in LATENCY_METRICS}
    for record in records:
        if not record.success:
            continue
        if record.ttft is not None:
            samples["ttft"].append(record.ttft)
        if record.tpot is not None:
            samples["tpot"].append(record.tpot)
        samples["itl"].extend(record.itl)
        samples["e2el"].append(record.e2el)
    return samples


def count_errors(records: Iterable[RequestRecord]) -> dict[str, int]:
    errors: dict[str, int] = {}
    for record in records:
        if not record.success:
            key = record.error or "unknown"
            errors[key] = errors.get(key, 0) + 1
    return dict(sorted(errors.items()))


def aggregate(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """One concurrency level's figures, with vLLM's key names. Token totals count the
    successful requests only; throughputs divide by the level's wall time."""
    done = [record for record in records if record.success]
    input_tokens = sum(record.input_tokens for record in done)
    output_tokens = sum(record.output_tokens for record in done)
    rate = (lambda amount: amount / duration_s) if duration_s > 0 else (lambda amount: 0.0)
    result: dict[str, Any] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": rate(len(done)),
        "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
        "usage_reported": sum(record.usage_reported for record in done),
    }
    for name, samples in latency_samples(records).items():
        result.update(summarize(name, samples))
    result["errors"] = count_errors(records)
    return result


# --- /metrics: speculative decoding counters -------------------------------------------

MetricKey = tuple[str, tuple[tuple[str, str], ...]]


def parse_counters(text: str) -> dict[MetricKey, float]:
    """Prometheus text -> {(name without `_total`, sorted labels): value}. The parser
    strips `_total` from counter *family* names but not from sample names, and untyped
    families keep it; normalising the sample name handles every case."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[MetricKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = sample.name.removesuffix("_total")
            counters[(name, tuple(sorted(sample.labels.items())))] = sample.value
    return counters


def counter_deltas(
    before: dict[MetricKey, float], after: dict[MetricKey, float]
) -> dict[MetricKey, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def sum_by(deltas: dict[MetricKey, float], name: str, label: str | None = None) -> dict:
    """Sum a counter over all labels, or grouped by one label's value."""
    grouped: dict[str, float] = {}
    for (metric, labels), value in deltas.items():
        if metric != name:
            continue
        key = dict(labels).get(label, "") if label else ""
        grouped[key] = grouped.get(key, 0.0) + value
    return grouped


def mode_switches(deltas: dict[MetricKey, float]) -> dict[str, float]:
    switches: dict[str, float] = {}
    for (metric, labels), value in deltas.items():
        if metric == MODE_SWITCHES:
            names = dict(labels)
            key = f"{names.get('from', '?')}->{names.get('to', '?')}"
            switches[key] = switches.get(key, 0.0) + value
    return dict(sorted(switches.items()))


def _position_order(item: tuple[str, float]) -> tuple[int, str]:
    return (len(item[0]), item[0])


def speculative_summary(deltas: dict[MetricKey, float]) -> dict[str, Any] | None:
    """vLLM's speculative figures from counter deltas over one level: acceptance rate =
    accepted / draft tokens; mean acceptance length = 1 + accepted / drafts (the bonus
    token counts); per-position rate = accepted at position / drafts. None when the
    server exports none of these counters."""
    names = {SPEC_DRAFTS, SPEC_DRAFT_TOKENS, SPEC_ACCEPTED, SPEC_ACCEPTED_PER_POS, MODE_SWITCHES}
    if not any(metric in names for metric, _ in deltas):
        return None
    drafts = sum(sum_by(deltas, SPEC_DRAFTS).values())
    draft_tokens = sum(sum_by(deltas, SPEC_DRAFT_TOKENS).values())
    accepted = sum(sum_by(deltas, SPEC_ACCEPTED).values())
    per_position = sum_by(deltas, SPEC_ACCEPTED_PER_POS, "position")
    return {
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": draft_tokens,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "spec_decode_acceptance_rate_per_position": {
            position: value / drafts if drafts else None
            for position, value in sorted(per_position.items(), key=_position_order)
        },
        "mode_switches": mode_switches(deltas),
        **batched_step_summary(deltas),
    }


def batched_step_summary(deltas: dict[MetricKey, float]) -> dict[str, Any]:
    """Tandem's batched steps over one level: their count, the share of their time spent
    in model forwards (the rest is scheduling, commit, detokenize, publish), and the
    tokens each row drafted per step (speculation staying on under load)."""
    steps = sum(sum_by(deltas, "tandem_step_model_seconds_count").values())
    if not steps:
        return {}
    model = sum(sum_by(deltas, "tandem_step_model_seconds_sum").values())
    overhead = sum(sum_by(deltas, "tandem_step_overhead_seconds_sum").values())
    rows = sum(sum_by(deltas, "tandem_spec_draft_tokens_per_row_count").values())
    drafted = sum(sum_by(deltas, "tandem_spec_draft_tokens_per_row_sum").values())
    return {
        "batched_steps": steps,
        "batched_step_model_share": model / (model + overhead) if model + overhead else None,
        "batched_step_mean_ms": 1000 * (model + overhead) / steps,
        "drafted_per_row_per_batched_step": drafted / rows if rows else None,
    }
