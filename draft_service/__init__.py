"""The draft service. Data flow: server.py (gRPC Speculate stream) -> scheduler.py (the target's
updates, batched drafting rounds) -> a drafter in drafters/ (behind drafter.py's `Drafter`);
config.py holds the flags, metrics.py the Prometheus metrics."""
