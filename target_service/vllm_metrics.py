"""The target's metrics under vLLM's names and labels, for the routers and tools that read vLLM's.

Gateways balance on `vllm:num_requests_waiting`, `vllm:num_requests_running` and
`vllm:kv_cache_usage_perc` (llm-d's endpoint picker; vLLM's production-stack router reads the
older `vllm:gpu_cache_usage_perc`); `vllm bench serve` reads the `vllm:spec_decode_*` counters,
and vLLM's dashboards the latency histograms and token counters. Each is a mirror of a tandem_*
metric, renamed when scraped, so that the step loop counts once. docs/design/metrics.md says
which vLLM metrics are not mirrored and why.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

# tandem name -> the vLLM names it is exported under
MIRRORED = {
    "tandem_num_requests_running": ("vllm:num_requests_running",),
    "tandem_num_requests_waiting": ("vllm:num_requests_waiting",),
    "tandem_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "tandem_cache_config_info": ("vllm:cache_config_info",),
    "tandem_num_preemptions": ("vllm:num_preemptions",),
    "tandem_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "tandem_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "tandem_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "tandem_spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
    "tandem_prompt_tokens": ("vllm:prompt_tokens",),
    "tandem_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "tandem_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "tandem_generation_tokens": ("vllm:generation_tokens",),
    "tandem_request_success": ("vllm:request_success",),
    "tandem_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "tandem_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",),
    "tandem_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "tandem_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
}
# vLLM's labels: model_name for our model, engine "0" (one engine core); finished_reason for ours.
RENAMED_LABELS = {"model": "model_name", "finish_reason": "finished_reason"}
DROPPED_LABELS = ("service",)
ENGINE = "0"


class VllmMirror(Collector):
    def __init__(self, families: dict[str, Counter | Gauge | Histogram]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for tandem_name, vllm_names in MIRRORED.items():
            for family in self.families[tandem_name].collect():
                for vllm_name in vllm_names:
                    yield _renamed(family, tandem_name, vllm_name)


def _renamed(family: Metric, tandem_name: str, vllm_name: str) -> Metric:
    mirror = Metric(vllm_name, family.documentation, family.type)
    for sample in family.samples:
        labels = {RENAMED_LABELS.get(k, k): v for k, v in sample.labels.items() if k not in DROPPED_LABELS}
        mirror.samples.append(Sample(vllm_name + sample.name[len(tandem_name):], {**labels, "engine": ENGINE},
                                     sample.value, sample.timestamp, sample.exemplar))
    return mirror
