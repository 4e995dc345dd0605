"""Scheduler settings: one frozen dataclass built by the CLI and passed down."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engines.gates import CostModel
from engines.request import GenerationRequest
from scheduler.throughput import ThroughputModel


@dataclass(frozen=True)
class SchedulerConfig:
    model: str
    draft_model: str | None = None
    num_draft_tokens: int = 4
    enable_pld: bool = True
    max_queue: int = 256  # requests waiting beyond the running ones; more get QueueFull
    max_num_seqs: int = 16  # requests decoding at once (the batch size bound)
    batch_threshold: int = 2  # active requests at which the batched engine takes over
    batch_return_steps: int = 4  # steps below the threshold before going back
    # Seconds a newcomer may wait for the running request to finish speculatively,
    # when measured speculative tok/s beats batching; 0 = batch at once.
    spec_wait_budget: float = 0.0
    batch_prefill_step_size: int = 512  # prefill chunk while batched (bounds others' gaps)
    prefix_cache_entries: int = 16  # finished requests' KV caches kept for reuse (0: off)
    prefix_cache_bytes: int = 2 << 30
    request_timeout: float = 0.0  # seconds from arrival; 0 = no limit
    fault_marker: str | None = None  # test hook: prompts containing this fail mid-generation
    # Extra logits processors per request (constrained decoding; tests force outputs).
    logits_processor_factory: Callable[[GenerationRequest], list] | None = None
    prefill_step_size: int = 2048
    cost_model: CostModel | None = None  # None: measure verify costs at startup
    throughput_model: ThroughputModel | None = None  # None: measure decode rates online
