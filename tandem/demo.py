"""`make demo`: the drafter and the target on loopback with the embedded model, one streamed chat
over gRPC, then one chat completion and one function call over the target's OpenAI-compatible HTTP API.

Each service gets one core (--threads 1), as docs/design/runtime.md (CPU threads) advises on a small box.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import urllib.request
from pathlib import Path

from tandem.cli import parser as cli_parser, run_generate
from tandem.launch import ServiceProcess, free_port
from tandem.registry import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL

# A request that copies much of its prompt, where drafts pay on any machine; on a small CPU the
# target's speed guard holds off drafts that do not (docs/design/speculation.md, The speed guard).
PROMPT = ("Correct any mistakes in the following text and return the full corrected text.\n\n"
          "Our team moved its build sytem from a single large script to a set of small tasks last month. "
          "Each task declares its inputs and outputs, so the build only reruns what changed. Clean builds "
          "take about as long as before, but incremental builds are much faster.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--drafter", choices=["model", "ngram", "suffix", "suffix+model"],
                        default="suffix", help="the draft service's --drafter (docs/drafters.md)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the target")
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL,
                        help="the model drafter's model: the distilled drafter by default")
    parser.add_argument("--max-tokens", type=int, default=512,
                        help="the chat's budget: room for the answer to end on its own")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="tandem-demo-"))
    draft_model = args.draft_model if "model" in args.drafter else args.model  # lookup drafters: its tokenizer
    draft = ServiceProcess("draft_service", ["--drafter", args.drafter, "--model", draft_model, "--threads", "1"],
                           log_path=logs / "draft.log")
    tools = ["--chat-template", "smollm2_tool_use", "--tool-call-parser", "hermes"] if args.model == DEFAULT_MODEL else []
    target = ServiceProcess("target_service", ["--model", args.model, "--threads", "1", "--drafter", draft.address,
                                               *tools], log_path=logs / "target.log", http_port=free_port())
    print(f"starting the draft service ({args.drafter}: {draft_model}) and the target service; logs in {logs}")
    try:
        draft.start()
        target.start()
        draft.wait_healthy()
        target.wait_healthy()
        print(f"target on {target.address} (OpenAI API {target.http_url}, metrics {target.metrics_url}), "
              f"drafter on {draft.address}\n")
        print(f"> {PROMPT}\n")
        cli_args = cli_parser().parse_args(["generate", PROMPT, "--chat", "--target", target.address,
                                        "--max-tokens", str(args.max_tokens)])
        asyncio.run(run_generate(cli_args))
        openai_chat(target.http_url, args.model)
        if tools:
            openai_tool_call(target.http_url, args.model)
    finally:
        codes = (target.terminate(), draft.terminate())
        print(f"stopped both services (exit codes {codes[0]}, {codes[1]})")


OPENAI_QUESTION = "Name the largest ocean in one word."


def openai_chat(base_url: str, model: str) -> None:
    """The same target through its OpenAI API, as `curl` or the OpenAI SDK would call it."""
    body = {"model": model, "messages": [{"role": "user", "content": OPENAI_QUESTION}], "max_tokens": 16,
            "temperature": 0}
    print(f"\n$ curl {base_url}/chat/completions -H 'Content-Type: application/json' -d '{json.dumps(body)}'")
    reply = _post(f"{base_url}/chat/completions", body)
    print(f"> {OPENAI_QUESTION}\n{reply['choices'][0]['message']['content']}  ({reply['usage']['completion_tokens']} "
          f"tokens, finish {reply['choices'][0]['finish_reason']})")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TOOL_QUESTION = "What is the weather in Paris?"


def openai_tool_call(base_url: str, model: str) -> None:
    """A function tool the answer must call: its arguments follow the tool's schema."""
    body = {"model": model, "messages": [{"role": "user", "content": TOOL_QUESTION}], "tools": [WEATHER],
            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 64, "temperature": 0}
    reply = _post(f"{base_url}/chat/completions", body)
    calls = reply["choices"][0]["message"].get("tool_calls") or []
    shown = ", ".join(f"{c['function']['name']}({c['function']['arguments']})" for c in calls) or "no call"
    print(f"\n> {TOOL_QUESTION}  (tools: get_weather, tool_choice: required)\n{shown}  "
          f"(finish {reply['choices'][0]['finish_reason']})")


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


if __name__ == "__main__":
    main()
