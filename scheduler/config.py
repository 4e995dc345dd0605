"""Scheduler settings: one frozen dataclass built by the CLI and passed down."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engines.gating.measured_costs import CostModel
from engines.request import GenerationRequest
from scheduler.throughput import ThroughputModel


@dataclass(frozen=True)
class SchedulerConfig:
    model: str
    draft_model: str | None = None
    draft_kind: str = "auto"  # --draft-kind: model, dflash, eagle3, assistant; auto: config.json
    gguf_dtype: str | None = None  # GGUF files import as this (None: float32 on CPU, else f16)
    # "tensor" or "pipeline": the target is sharded over the ranks `mlx.launch` started,
    # which repeat this process's forwards (engines/distributed/lockstep.py).
    distributed: str | None = None
    num_draft_tokens: int | None = None  # None: SpecConfig's defaults (see for_server)
    # The draft model scores only this many frequent tokens (plus special and each
    # request's own); None: engines.drafting.draft_vocab's automatic size; 0: all.
    draft_vocab: int | None = None
    # The model's own MTP head drafts when it has one and no draft model is given;
    # mtp_weights: where its mtp.* weights are, when not in the model's own files.
    mtp: bool = True
    mtp_weights: str | None = None
    enable_pld: bool = True
    max_queue: int = 256  # requests waiting beyond the running ones; more get QueueFull
    max_num_seqs: int = 16  # requests decoding at once (the batch size bound)
    # Running + queued requests one API key may hold; 0 = max_num_seqs + half the queue
    # (rounded up), so another key finds a queue place. Keyless servers have no cap.
    max_per_key: int = 0
    # Backpressure: a stream with more undelivered events than this is paused (its
    # sequence leaves the engine, KV cache kept) until its client reads; 0 = never.
    max_unread_events: int = 256
    unread_timeout: float = 30.0  # seconds paused before the request is cancelled
    batch_threshold: int = 2  # active requests at which the batched engine takes over
    batch_return_steps: int = 4  # steps below the threshold before going back
    # Seconds a newcomer may wait for the running request to finish speculatively,
    # when measured speculative tok/s beats batching; 0 = batch at once.
    spec_wait_budget: float = 0.0
    batch_prefill_step_size: int = 512  # prefill chunk while batched (bounds others' gaps)
    prefix_cache_entries: int = 16  # finished requests' KV caches kept for reuse (0: off)
    prefix_cache_bytes: int = 2 << 30
    # The prefix cache's tier on disk (scheduler/prefix_disk.py): its directory (None:
    # the user's cache directory) and bound in bytes; 0 = off (here; the CLI's is on).
    prefix_cache_dir: str | None = None
    prefix_cache_disk_bytes: int = 0
    # Suffix decoding (scheduler/suffix_store.py): each API key's recent requests, at
    # most this many tokens per key (about 110 bytes each) and this many keys, draft
    # for its new requests (0: off).
    suffix_tokens_per_key: int = 1 << 16
    # Prefill followers (scheduler/prefill_followers.py): a request waits for a running
    # prefill of its key that shares at least this many prompt tokens with it (0: never),
    # unless that prefill makes no progress for `prefill_follow_stall_s` seconds.
    prefill_follow_min_tokens: int = 256
    prefill_follow_stall_s: float = 60.0
    suffix_max_keys: int = 32
    # KV memory of running requests and the prefix cache together (--max-kv-gb);
    # None: a share of the machine's memory (scheduler/kv_budget.py)
    max_kv_bytes: int | None = None
    request_timeout: float = 0.0  # seconds from arrival; 0 = no limit
    fault_marker: str | None = None  # test hook: prompts containing this fail mid-generation
    # Extra logits processors per request (constrained decoding; tests force outputs).
    logits_processor_factory: Callable[[GenerationRequest], list] | None = None
    prefill_step_size: int = 2048
    # pixels a vision model's tower encodes in one batch (--max-tower-pixels; None: its
    # default, engines.model.vision.TOWER_PIXELS)
    max_tower_pixels: int | None = None
    cost_model: CostModel | None = None  # None: measure verify costs at startup
    throughput_model: ThroughputModel | None = None  # None: measure decode rates online

    @property
    def per_key_limit(self) -> int:
        return self.max_per_key or max(1, self.max_num_seqs + (self.max_queue + 1) // 2)
