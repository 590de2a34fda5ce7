"""The OpenAI-compatible HTTP API of the target (--http-port)."""
