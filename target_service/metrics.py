"""The target's Prometheus metrics (docs/design/metrics.md), in a registry of their own."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from target_service.speculation.speed_guard import GuardFigures
from target_service.vllm_metrics import VllmMirror

# 1 ms upwards, roughly doubling: resolves CPU decode steps and GPU TTFT alike.
MASK_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
LATENCY_BUCKETS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512,
                   1.024, 2.048, 4.096, 8.192, 16.384, 32.768, 65.536)
ACCEPTANCE_BUCKETS = tuple(range(0, 17))


CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks")


class TargetMetrics:
    def __init__(self, model: str):
        self.registry = CollectorRegistry()
        labels = {"model": model, "service": "target"}
        names = list(labels)
        self.families: dict[str, Counter | Gauge | Histogram] = {}  # by name, for the vLLM mirror

        def bind(name: str, metric, extra: tuple[str, ...]):
            """Metrics without extra labels come bound to model and service; the rest via `child`."""
            self.families[name] = metric
            return metric if extra else metric.labels(**labels)

        def histogram(name: str, doc: str, buckets=LATENCY_BUCKETS, extra: tuple[str, ...] = ()):
            metric = Histogram(name, doc, names + list(extra), buckets=buckets, registry=self.registry)
            return bind(name, metric, extra)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return bind(name, Counter(name, doc, names + list(extra), registry=self.registry), extra)

        def gauge(name: str, doc: str):
            return bind(name, Gauge(name, doc, names, registry=self.registry), ())

        self.ttft = histogram("tandem_time_to_first_token_seconds", "Arrival to first token sent.")
        self.itl = histogram("tandem_inter_token_latency_seconds", "Time between tokens sent to a client.")
        self.e2e = histogram("tandem_e2e_request_latency_seconds", "Arrival to last token.")
        self.queue_time = histogram("tandem_request_queue_time_seconds", "Arrival to admission.")
        self.step = histogram("tandem_step_duration_seconds", "Model step time by kind.", extra=("kind",))
        self.draft_rtt = histogram("tandem_draft_rtt_seconds", "Update sent to the drafter until its proposal arrived.")
        self.draft_wait = histogram("tandem_draft_wait_seconds", "Time a step waited for drafts (steps that waited).")
        self.acceptance_length = histogram(
            "tandem_acceptance_length", "Tokens emitted per verify step (accepted + 1).", buckets=ACCEPTANCE_BUCKETS
        )
        self.prompt_tokens = counter("tandem_prompt_tokens", "Prompt tokens prefilled.")
        self.prefix_cache_queries = counter("tandem_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter(
            "tandem_prefix_cache_hits", "Prompt tokens whose KV the prefix cache held: not prefilled again.")
        self.generation_tokens = counter("tandem_generation_tokens", "Tokens generated.")
        self.request_success = counter("tandem_request_success", "Finished requests.", extra=("finish_reason",))
        self.num_drafts = counter("tandem_spec_decode_num_drafts", "Verify steps run with at least one draft.")
        self.num_draft_tokens = counter("tandem_spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("tandem_spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter(
            "tandem_spec_decode_num_accepted_tokens_per_pos", "Accepted drafts by position.", extra=("position",)
        )
        self.preemptions = counter(
            "tandem_num_preemptions", "Running sequences preempted for KV blocks (recomputed when readmitted).")
        self.draft_miss = counter("tandem_draft_miss", "Steps where a speculating sequence had no usable draft.")
        self.draft_local = counter(
            "tandem_draft_local", "Steps where a speculating sequence verified the target's own lookup, the drafter's "
                                  "proposals having none for its tokens.")
        self.draft_stale = counter("tandem_draft_stale", "Stale proposals by outcome.", extra=("outcome",))
        self.draft_rejected = counter("tandem_draft_rejected_proposals", "Invalid proposals dropped.", extra=("reason",))
        self.draft_cache_hits = counter(
            "tandem_draft_cache_hits", "Steps whose drafts came from a pre-draft: the drafter had them ready.")
        self.draft_cache_evicted = counter(
            "tandem_draft_cache_evicted", "Pre-drafts dropped unused: the target committed other tokens than they assumed.")
        self.draft_cache_held = histogram(
            "tandem_draft_cache_proposals", "Proposals a sequence held when its step was planned.",
            buckets=ACCEPTANCE_BUCKETS)
        self.structured_requests = counter(
            "tandem_structured_requests", "Requests with a structured-output constraint, by kind.", extra=("kind",))
        self.grammar_compile = histogram(
            "tandem_grammar_compile_seconds", "Compiling a constraint that was not cached.", buckets=MASK_BUCKETS)
        self.grammar_mask = histogram(
            "tandem_grammar_mask_seconds", "Computing a step's token bitmasks (steps with constrained sequences).",
            buckets=MASK_BUCKETS)
        self.draft_wire_bytes = counter("tandem_draft_wire_bytes", "Bytes of proposals received from the drafter.")
        self.hidden_state_bytes = counter(
            "tandem_hidden_state_bytes", "Bytes of target features sent to a drafter that reads them (EAGLE-3 style).")
        self.running = gauge("tandem_num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("tandem_num_requests_waiting", "Requests waiting for admission.")
        self.kv_usage = gauge("tandem_kv_cache_usage_perc", "Share of the KV cache in use, 0 to 1 (blocks held by running sequences).")
        self.cache_config = bind("tandem_cache_config_info", Gauge(
            "tandem_cache_config_info", "The KV cache's configuration, in the labels (value 1).",
            names + list(CACHE_CONFIG_LABELS), registry=self.registry), CACHE_CONFIG_LABELS)
        self.drafter_connected = gauge("tandem_drafter_connected", "1 while a compatible drafter is connected.")
        self.drafts_requested = gauge(
            "tandem_spec_decode_requested_drafts",
            "Drafts per sequence the target last asked the drafter for, the batch's mean; 0 while none would pay.")
        self.realized_speedup = gauge(
            "tandem_spec_decode_realized_speedup",
            "Tokens per second of wall time in steps that could speculate, over what the target alone makes at "
            "that batch size, as the speed guard measures them (a moving average; 0 until measured).")
        self.step_fixed_cost = gauge(
            "tandem_spec_decode_step_fixed_seconds",
            "The policy's fitted cost of a decode or verify step: its fixed seconds (a least-squares line over recent "
            "steps, by their tokens).")
        self.step_token_cost = gauge(
            "tandem_spec_decode_step_token_seconds",
            "The policy's fitted cost of a decode or verify step: seconds per token in it, what a draft is priced at.")
        self.tokens_vs_alone = counter(
            "tandem_spec_decode_tokens_vs_alone",
            "Tokens that steps able to speculate made beyond (gained) or short of (lost) what the target alone "
            "would have made in their time.", extra=("outcome",))
        self.guard_decisions = counter(
            "tandem_spec_decode_guard_decisions",
            "Sequences the speed guard held off speculating, measured to lose (hold), or let speculate again "
            "(release).", extra=("decision",))
        self.guard_windows = counter(
            "tandem_spec_decode_guard_windows",
            "The speed guard's exploring windows: on (every sequence may speculate) or off (none may).",
            extra=("kind",))
        self._labels = labels
        for metric, label, values in ((self.tokens_vs_alone, "outcome", ("gained", "lost")),
                                      (self.guard_decisions, "decision", ("hold", "release")),
                                      (self.guard_windows, "kind", ("on", "off"))):
            for value in values:  # exported at 0 from the start, so that rates and alerts see them
                self.child(metric, **{label: value})
        self.registry.register(VllmMirror(self.families))

    def observe_guard(self, before: GuardFigures, after: GuardFigures, speedup: float | None) -> None:
        """The speed guard's figures after a step, counted from those before it."""
        for outcome in ("gained", "lost"):
            if grown := getattr(after, outcome) - getattr(before, outcome):
                self.child(self.tokens_vs_alone, outcome=outcome).inc(grown)
        for decision, name in (("hold", "holds"), ("release", "releases")):
            if grown := getattr(after, name) - getattr(before, name):
                self.child(self.guard_decisions, decision=decision).inc(grown)
        for kind, name in (("on", "on_windows"), ("off", "off_windows")):
            if grown := getattr(after, name) - getattr(before, name):
                self.child(self.guard_windows, kind=kind).inc(grown)
        if speedup is not None:
            self.realized_speedup.set(speedup)

    def describe_cache(self, block_size: int, num_blocks: int, dtype: str, prefix_caching: bool) -> None:
        """The KV cache's configuration, under vLLM's label names (num_gpu_blocks on any device)."""
        values = (str(block_size), dtype, str(prefix_caching), str(num_blocks))
        self.child(self.cache_config, **dict(zip(CACHE_CONFIG_LABELS, values))).set(1)

    def watch_kv_usage(self, usage: Callable[[], float]) -> None:
        """The KV gauge reads the engine's figure when scraped."""
        self.kv_usage.set_function(usage)

    def child(self, metric, **extra: str):
        """The child of a metric with extra labels (step kind, finish reason, position, ...)."""
        return metric.labels(**self._labels, **extra)
