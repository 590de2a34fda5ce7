"""Hypothesis settings the request fuzzers share."""
from __future__ import annotations

from hypothesis import HealthCheck, settings


def fuzz_settings(examples: int) -> settings:
    """The short run draws the same examples every time, as Hypothesis advises for CI; the long one explores."""
    return settings(max_examples=examples, deadline=None, database=None, derandomize=examples < 1000,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
