"""Reading a service's Prometheus /metrics page from outside, as tests and benchmarks do."""
from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class Sample:
    name: str  # the sample's own name: tandem_x_total, tandem_y_seconds_bucket, ...
    labels: dict[str, str]
    value: float


def scrape(url: str, timeout: float = 5.0) -> list[Sample]:
    """Every sample on the page."""
    text = urllib.request.urlopen(url, timeout=timeout).read().decode()
    return [Sample(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples]


def metric(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum over the samples named `name` whose labels include `labels`."""
    return sum(s.value for s in samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
