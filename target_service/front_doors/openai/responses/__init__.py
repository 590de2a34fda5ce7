"""OpenAI's Responses API on the HTTP door (`/v1/responses`), as a translation of chat completions.

A request becomes a chat completion request (protocol.py): its input items and the history of the
response it continues become messages, its function tools and `text.format` become chat's `tools` and
`response_format`, so that tools, constraints and sampling take the path chat completions take. The
answer becomes output items and, streamed, OpenAI's events (output.py). Responses asked to be
stored are kept in memory, the oldest forgotten past a bound (store.py).
"""
