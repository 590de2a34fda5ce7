"""One streamed OpenAI chat completion, recorded as bench.load records a gRPC generation, and a load of them.

What any OpenAI client sends: `stream: true` with `stream_options.include_usage`, so that the
token count comes from the server's usage chunk. The first content chunk is the first token;
each later content chunk is one gap (it holds several tokens when drafts were accepted).
"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from bench.load import Arrivals, RequestRecord, RunResult, drive, failed_record
from bench.prompt_set import Prompt


def chat_body(prompt: Prompt, model: str, temperature: float, max_tokens: int, seed: int | None,
              speculate: bool | None) -> dict:
    body = {"model": model, "messages": prompt.as_dicts(), "temperature": temperature, "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        body["seed"] = seed
    if speculate is not None:
        body["speculate"] = speculate
    return body


async def stream_chat(session: aiohttp.ClientSession, url: str, prompt: Prompt, body: dict,
                      sent: float, timeout: float) -> RequestRecord:
    start = time.perf_counter()
    chunk_times: list[float] = []
    usage: dict = {}
    spec: dict = {}
    finish = ""
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        if response.status != 200:
            return failed_record(prompt, sent, f"HTTP {response.status}: {(await response.text())[:200]}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return failed_record(prompt, sent, chunk["error"]["message"])
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    chunk_times.append(time.perf_counter() - start)
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                usage = chunk["usage"]
                spec = (chunk.get("metrics") or {}).get("speculative_decoding") or {}
    elapsed = time.perf_counter() - start
    return RequestRecord(
        prompt_id=prompt.id, kind=prompt.kind, sent=sent, ttft=chunk_times[0] if chunk_times else elapsed,
        e2e=elapsed, prompt_tokens=usage.get("prompt_tokens", 0),
        completion_tokens=usage.get("completion_tokens", 0),
        draft_tokens=spec.get("num_draft_tokens", 0), accepted_tokens=spec.get("num_accepted_draft_tokens", 0),
        draft_steps=spec.get("num_spec_steps", 0), finish_reason=finish,
        itl=[b - a for a, b in zip(chunk_times, chunk_times[1:])])


async def run_http_load(url: str, model: str, prompts: list[Prompt], arrivals: Arrivals, *, temperature: float,
                        max_tokens: int, speculate: bool | None, seed: int = 0, timeout: float = 600.0) -> RunResult:
    """bench.load's run_load over OpenAI's chat completions at `url`, streamed, as an OpenAI client sends them."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(i: int, sent: float) -> RequestRecord:
            body = chat_body(prompts[i], model, temperature, max_tokens, seed + i if temperature > 0 else None,
                             speculate)
            try:
                return await stream_chat(session, url, prompts[i], body, sent, timeout)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                return failed_record(prompts[i], sent, repr(e))

        return await drive(len(prompts), arrivals, one)
