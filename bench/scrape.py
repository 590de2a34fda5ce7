"""Reads the target's /metrics before and after each run, for what only the server sees (draft misses)."""
from __future__ import annotations

from tandem.metrics_scrape import metric, scrape


COUNTERS = {
    "draft_miss": "tandem_draft_miss_total",
    "draft_local": "tandem_draft_local_total",
    "drafts": "tandem_spec_decode_num_drafts_total",
    "draft_tokens": "tandem_spec_decode_num_draft_tokens_total",
    "accepted_tokens": "tandem_spec_decode_num_accepted_tokens_total",
    "stale_salvaged": ("tandem_draft_stale_total", {"outcome": "salvaged"}),
    "stale_dropped": ("tandem_draft_stale_total", {"outcome": "dropped"}),
    "rejected_proposals": "tandem_draft_rejected_proposals_total",
    "draft_rtt_sum": "tandem_draft_rtt_seconds_sum",
    "draft_rtt_count": "tandem_draft_rtt_seconds_count",
    "draft_wait_sum": "tandem_draft_wait_seconds_sum",
    **{f"guard_{outcome}": ("tandem_spec_decode_tokens_vs_alone_total", {"outcome": outcome})
       for outcome in ("gained", "lost")},
    "server_ttft_sum": "tandem_time_to_first_token_seconds_sum",
    "server_ttft_count": "tandem_time_to_first_token_seconds_count",
    **{f"step_{kind}_{part}": (f"tandem_step_duration_seconds_{part}", {"kind": kind})
       for kind in ("prefill", "decode", "verify") for part in ("sum", "count")},
}


def counters(url: str) -> dict[str, float]:
    samples = scrape(url)
    out = {}
    for field, spec in COUNTERS.items():
        name, labels = (spec, {}) if isinstance(spec, str) else spec
        out[field] = metric(samples, name, **labels)
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def server_summary(d: dict[str, float]) -> dict[str, float | None]:
    """Draft-miss rate = steps of a speculating sequence with no usable draft / all its steps."""
    steps = d["draft_miss"] + d["drafts"]

    def mean(prefix: str) -> float | None:
        return d[f"{prefix}_sum"] / d[f"{prefix}_count"] if d[f"{prefix}_count"] else None

    return {
        **d,
        "draft_miss_rate": d["draft_miss"] / steps if steps else None,
        "mean_draft_rtt_s": mean("draft_rtt"),
        "mean_server_ttft_s": mean("server_ttft"),
        **{f"mean_step_{kind}_s": mean(f"step_{kind}") for kind in ("prefill", "decode", "verify")},
    }
