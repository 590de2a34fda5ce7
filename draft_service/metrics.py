"""The draft service's Prometheus metrics, in their own registry (docs/design.md, Metrics)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds, from 1 ms: a drafting round on a GPU takes a few ms, on a busy CPU up to seconds.
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Why an update from the target was skipped (the `reason` label of tandem_draft_invalid_updates_total).
INVALID_REASONS = (
    "unknown_seq", "duplicate_seq", "empty_prompt", "prompt_too_long", "no_free_slot",
    "bad_k", "bad_token_id", "bad_sampling", "bad_start",
)


class DraftMetrics:
    """Every metric carries the labels model and service="draft"."""

    def __init__(self, model: str):
        self.registry = CollectorRegistry()
        names = ["model", "service"]
        values = (model, "draft")

        def histogram(name: str, doc: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, names, registry=self.registry, buckets=buckets).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=self.registry).labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry).labels(*values)

        self.step_duration = histogram(
            "tandem_draft_step_duration_seconds", "One drafting round: k draft tokens for every sequence in the batch")
        self.prefill_duration = histogram(
            "tandem_draft_prefill_duration_seconds", "The first forward of a round that prefills new prompts")
        self.batch_size = histogram(
            "tandem_draft_batch_size", "Sequences drafted together in one round", BATCH_BUCKETS)
        self.updates = counter("tandem_draft_updates", "TargetUpdate messages received")
        self.proposals = counter("tandem_draft_proposals", "Draft proposals sent")
        self.tokens = counter("tandem_draft_tokens", "Draft tokens sent")
        self.reused_tokens = counter(
            "tandem_draft_reused_tokens", "Committed tokens whose KV came from earlier drafts, not recomputed")
        self.errors = counter("tandem_draft_errors", "Drafting rounds that failed (logged with a traceback)")
        self.sequences = gauge("tandem_draft_sequences", "Open sequences, all streams together")
        self.streams = gauge("tandem_draft_streams", "Open Speculate streams (connected targets)")
        invalid = Counter("tandem_draft_invalid_updates", "Opens, Extends and Closes skipped as invalid",
                          [*names, "reason"], registry=self.registry)
        self._invalid = {reason: invalid.labels(*values, reason) for reason in INVALID_REASONS}

    def count_invalid(self, reason: str) -> None:
        self._invalid[reason].inc()
