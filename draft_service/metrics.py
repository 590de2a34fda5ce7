"""The draft service's Prometheus metrics, in their own registry (docs/design/metrics.md)."""
from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

# Seconds, from 1 ms: a drafting round on a GPU takes a few ms, on a busy CPU up to seconds.
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FANOUT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16)
# Whose next token a guess was (the `guess` label): the recovered token after a rejection, or the bonus one.
GUESS_KINDS = ("recovered", "bonus")
# When an Extend made a pre-draft moot (the `stage` label): before its round started, or while it ran.
CANCEL_STAGES = ("pending", "drafted")

# Why an update from the target was skipped (the `reason` label of tandem_draft_invalid_updates_total).
INVALID_REASONS = (
    "unknown_seq", "duplicate_seq", "empty_prompt", "prompt_too_long", "no_free_slot", "target_quota",
    "bad_k", "bad_token_id", "bad_sampling", "bad_start", "bad_constraint", "bad_hidden_states", "bad_prompt_len",
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

        def by_label(name: str, doc: str, label: str, label_values: tuple[str, ...]) -> dict[str, Counter]:
            """A counter per value of one more label, each series there from the start."""
            family = Counter(name, doc, [*names, label], registry=self.registry)
            return {value: family.labels(*values, value) for value in label_values}

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
        self.prefix_cache_queries = counter(
            "tandem_draft_prefix_cache_queries", "Tokens of new sequences looked up in the model drafter's prefix cache")
        self.prefix_cache_hits = counter(
            "tandem_draft_prefix_cache_hits", "Tokens of new sequences whose KV a kept slot held: not prefilled again")
        self.suffix_proposals = counter(
            "tandem_draft_suffix_proposals", "Proposals the suffix drafter answered in front of the model (suffix+model)")
        self.errors = counter("tandem_draft_errors", "Drafting rounds that failed (logged with a traceback)")
        self.sequences = gauge("tandem_draft_sequences", "Open sequences, all streams together")
        self.streams = gauge("tandem_draft_streams", "Open Speculate streams (connected targets)")
        self._invalid = by_label("tandem_draft_invalid_updates", "Opens, Extends and Closes skipped as invalid",
                                 "reason", INVALID_REASONS)
        self.idle = IdleTime()
        self.registry.register(IdleCollector(self.idle, values))
        self.predraft_proposals = counter(
            "tandem_draft_predraft_proposals", "Pre-drafts sent: proposals that assume tokens the target has not sent")
        self.predraft_hits = counter(
            "tandem_draft_predraft_hits", "Extends that committed exactly a sent pre-draft's assumed tokens")
        self.fanout = histogram(
            "tandem_draft_fanout", "Outcomes of one proposal pre-drafted in a round, per sequence", FANOUT_BUCKETS)
        self.fanout_limit = gauge(
            "tandem_draft_fanout_limit", "Outcomes per proposal the drafter's spare time allows now")
        self.predraft_depth = gauge(
            "tandem_draft_predraft_depth",
            "Verifications ahead the drafter last pre-drafted for a target: its round trip over its step time")
        self.predraft_cancelled = by_label(
            "tandem_draft_predraft_cancelled", "Pre-drafts an Extend made moot before they were sent",
            "stage", CANCEL_STAGES)
        self.outcomes_seen = by_label(
            "tandem_draft_predraft_outcomes", "Verification outcomes seen whose next token the drafter had guessed",
            "guess", GUESS_KINDS)
        self.guesses_right = by_label(
            "tandem_draft_predraft_guess_hits", "Guesses at the next token that the target committed",
            "guess", GUESS_KINDS)

    def count_invalid(self, reason: str) -> None:
        self._invalid[reason].inc()


class IdleTime:
    """Seconds the drafting loop had nothing to draft, counted up to the moment they are read: an idle
    spell may last minutes, and a scrape during it must see it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the event loop writes, the /metrics thread reads
        self._total = 0.0
        self._since: float | None = None

    def begin(self) -> None:
        with self._lock:
            self._since = time.perf_counter()

    def end(self) -> None:
        with self._lock:
            if self._since is not None:
                self._total += time.perf_counter() - self._since
                self._since = None

    def seconds(self) -> float:
        with self._lock:
            return self._total + (0.0 if self._since is None else time.perf_counter() - self._since)


class IdleCollector:
    """tandem_draft_idle_seconds_total: its rate is the drafter's idle share (idle time / wall time)."""

    def __init__(self, idle: IdleTime, label_values: tuple[str, str]):
        self._idle = idle
        self._label_values = list(label_values)

    def collect(self):
        family = CounterMetricFamily("tandem_draft_idle_seconds", "Time with nothing to draft; its rate is the "
                                     "drafter's idle share", labels=["model", "service"])
        family.add_metric(self._label_values, self._idle.seconds())
        yield family
