"""The front doors: tandem.v1's Generation service, vLLM's engine protocol (vllm_engine/) and the
OpenAI HTTP API (openai/), and the request path they share (serving.py: validation, grammars, tools,
admission and abort), on the servers the target's flags open (servers.py)."""
