"""The draft service. Data flow: server.py (gRPC Speculate stream) -> scheduler.py (the target's
updates, batched drafting rounds) -> model_drafter.py or ngram_drafter.py (behind drafter.py's
`Drafter`); config.py holds the flags, metrics.py the Prometheus metrics."""
