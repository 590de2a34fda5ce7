"""Summaries of a run: percentiles per figure, acceptance, and the ratios the README reports."""
from __future__ import annotations

import math
from collections.abc import Iterable

from bench.load import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Iterable[float]) -> dict[str, float | None]:
    xs = [v for v in values if v is not None]
    out = {f"p{q}": percentile(xs, q) for q in PERCENTILES}
    out["mean"] = sum(xs) / len(xs) if xs else None
    out["n"] = len(xs)
    return out


def acceptance(records: list[RequestRecord]) -> dict[str, float | int]:
    """Acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / draft steps."""
    draft = sum(r.draft_tokens for r in records)
    accepted = sum(r.accepted_tokens for r in records)
    steps = sum(r.draft_steps for r in records)
    return {"draft_tokens": draft, "accepted_tokens": accepted, "draft_steps": steps,
            "acceptance_rate": accepted / draft if draft else None,
            "mean_acceptance_length": 1 + accepted / steps if steps else None}


def summarize(records: list[RequestRecord], duration: float) -> dict:
    ok = [r for r in records if not r.error]
    tokens = sum(r.completion_tokens for r in ok)
    kinds = sorted({r.kind for r in ok})
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "duration_s": duration,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / duration if duration > 0 else None,
        "request_rate": len(ok) / duration if duration > 0 else None,
        "ttft_s": distribution(r.ttft for r in ok),
        "tpot_s": distribution(r.tpot for r in ok),
        "itl_s": distribution(x for r in ok for x in r.itl),
        "e2e_s": distribution(r.e2e for r in ok),
        "acceptance": acceptance(ok),
        "acceptance_by_kind": {k: acceptance([r for r in ok if r.kind == k]) for k in kinds},
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def paired_ratio(values: list[float], references: list[float]) -> tuple[float, float] | None:
    """The geometric mean of values[i] / references[i], measured side by side (the same prompts, one
    after the other), and its spread: twice the standard error of the mean log ratio, as a factor
    (the ratio is likely within mean / spread .. mean x spread; with a handful of pairs, less
    likely than the 95% of a normal law). None with fewer than two pairs.
    Pairs cancel the machine's drift that one total over a run of minutes keeps."""
    if len(values) != len(references) or len(values) < 2 or min(*values, *references) <= 0:
        return None  # a group that made nothing has no ratio
    logs = [math.log(v / r) for v, r in zip(values, references, strict=True)]
    mean = sum(logs) / len(logs)
    spread = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1) / len(logs))
    return math.exp(mean), math.exp(2 * spread)
