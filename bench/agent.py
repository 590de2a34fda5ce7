"""An agent workload through the OpenAI door: conversations that call a tool, get its result (a code
file, a JSON record, a policy document) and answer with it, the history growing turn by turn.

    python -m bench.agent [--drafters suffix,suffix+model] [--rtt-ms 0] [--max-tokens 96]
                          [--conversations 6] [--out bench/results/agent]

Each conversation (bench/prompts/agent.jsonl) is 3-4 user turns. A turn with a tool result is two
requests: the call (tool_choice naming the function: its arguments constrained to the schema), then,
after the call and its result join the history, the answer (tool_choice none); a follow-up turn is
one request, answered from the history. Chat completions, streamed with usage, greedy.

Configurations, all up at once with one thread each: the target alone; a pair per drafter; and a
pair of the first drafter with every request `speculate: false` (speculation off, the pair's own
overheads kept). Every conversation goes to each configuration in turn, the order rotating, so
that the machine's drift falls on all alike. --rtt-ms puts a delay proxy between each target and
its drafter. Per configuration: tokens/s over every request and its ratio to the target alone,
the answers' tokens/s alone, TTFT p50, MAL (tokens per verify step), the share of prompt tokens the
prefix cache held, and how many conversations equal the target alone's token for token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.delay_proxy import ProxyProcess
from bench.network import drafter_flags
from bench.serve import DRAFTERS
from tandem.launch import ServiceProcess, free_port
from tandem.registry import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL

CONVERSATIONS = Path(__file__).parent / "prompts" / "agent.jsonl"
ALONE, OFF = "alone", "off"
TARGET_FLAGS = ["--threads", "1", "--max-model-len", "4096", "--chat-template", "smollm2_tool_use"]


@dataclass
class Reply:
    """One streamed request: what it said, and how it went."""

    text: str
    calls: list[dict]
    seconds: float
    ttft: float
    usage: dict
    spec: dict


@dataclass
class Config:
    name: str
    target: ServiceProcess
    speculate: bool | None = None  # sent with every request; None: the server's default
    helpers: list = field(default_factory=list)  # the draft service and proxy of a pair

    def stop(self) -> None:
        self.target.terminate(10)
        for helper in self.helpers:
            helper.terminate()


@dataclass
class AgentTally:
    """One configuration's requests, summed."""

    config: str
    replies: list[tuple[str, Reply]] = field(default_factory=list)  # (call or answer, reply)
    transcripts: dict[str, list] = field(default_factory=dict)


async def stream(session: aiohttp.ClientSession, url: str, body: dict) -> Reply:
    """A chat completion streamed with usage: its text and calls, wall time and first token's time."""
    began = time.perf_counter()
    ttft = None
    text, calls, usage, spec = "", {}, {}, {}
    async with session.post(url + "/chat/completions", json={**body, "stream": True,
                                                            "stream_options": {"include_usage": True}}) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if ttft is None and (delta.get("content") or delta.get("tool_calls")):
                    ttft = time.perf_counter() - began
                text += delta.get("content") or ""
                for entry in delta.get("tool_calls") or ():
                    call = calls.setdefault(entry["index"], {"id": entry.get("id"), "type": "function",
                                                             "function": {"name": entry["function"].get("name"),
                                                                          "arguments": ""}})
                    call["function"]["arguments"] += entry["function"].get("arguments") or ""
            if chunk.get("usage"):
                usage = chunk["usage"]
                spec = (chunk.get("metrics") or {}).get("speculative_decoding") or {}
    seconds = time.perf_counter() - began
    return Reply(text, [calls[i] for i in sorted(calls)], seconds, ttft or seconds, usage, spec)


async def converse(config: Config, conversation: dict, max_tokens: int, tally: AgentTally) -> None:
    """One conversation on one configuration, its replies added to the tally."""
    tool = conversation["tool"]
    messages = [{"role": "system", "content": conversation["system"]}]
    transcript = []
    base = {"model": DEFAULT_MODEL, "temperature": 0, "tools": [tool]}
    if config.speculate is not None:
        base["speculate"] = config.speculate
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for turn in conversation["turns"]:
            messages.append({"role": "user", "content": turn["user"]})
            if turn["result"] is not None:
                named = {"type": "function", "function": {"name": tool["function"]["name"]}}
                call = await stream(session, config.target.http_url,
                                    {**base, "messages": messages, "tool_choice": named, "max_tokens": 40})
                tally.replies.append(("call", call))
                [made] = call.calls or [{"id": "call_0", "type": "function",
                                         "function": {"name": tool["function"]["name"], "arguments": "{}"}}]
                transcript.append(made["function"]["arguments"])
                messages += [{"role": "assistant", "content": None, "tool_calls": [made]},
                             {"role": "tool", "tool_call_id": made["id"], "content": turn["result"]}]
            answer = await stream(session, config.target.http_url,
                                  {**base, "messages": messages, "tool_choice": "none", "max_tokens": max_tokens})
            tally.replies.append(("answer", answer))
            transcript.append(answer.text)
            messages.append({"role": "assistant", "content": answer.text})
    tally.transcripts[conversation["id"]] = transcript


def start(args: argparse.Namespace, logs: Path) -> list[Config]:
    configs = [Config(ALONE, ServiceProcess("target_service", ["--model", args.model, *TARGET_FLAGS],
                                            log_path=logs / "target-alone.log", http_port=free_port()).start())]
    for name in [*args.drafters, OFF]:
        drafter = args.drafters[0] if name == OFF else name
        tag = name.translate(str.maketrans("+/=", "___"))
        draft = ServiceProcess("draft_service", [*drafter_flags(drafter, args), "--threads", "1"],
                               log_path=logs / f"draft-{tag}.log").start()
        helpers: list = [draft]
        address = draft.address
        if args.rtt_ms > 0:
            proxy = ProxyProcess(draft.address, args.rtt_ms / 2, 0.0, log_path=logs / f"proxy-{tag}.log").start()
            helpers.append(proxy)
            address = proxy.address
        target = ServiceProcess("target_service", ["--model", args.model, *TARGET_FLAGS, "--drafter", address],
                                log_path=logs / f"target-{tag}.log", http_port=free_port()).start()
        configs.append(Config(f"{drafter}, speculation off" if name == OFF else name, target,
                              False if name == OFF else None, helpers))
    for config in configs:
        config.target.wait_healthy(300)
        if config.helpers:
            config.helpers[0].wait_healthy(300)
            config.target.wait_metric("tandem_drafter_connected", 1.0)
    return configs


def drive(configs: list[Config], conversations: list[dict], max_tokens: int) -> dict[str, AgentTally]:
    """Each conversation to every configuration in turn, the order rotating."""
    tallies = {config.name: AgentTally(config.name) for config in configs}
    for index, conversation in enumerate(conversations):
        order = configs[index % len(configs):] + configs[:index % len(configs)]
        for config in order:
            asyncio.run(converse(config, conversation, max_tokens, tallies[config.name]))
        print(f"  {conversation['id']}: " + ", ".join(f"{t.config} {_rate(t.replies):.1f} tok/s"
                                                      for t in tallies.values()), flush=True)
    return tallies


def _rate(replies: list[tuple[str, Reply]]) -> float:
    seconds = sum(reply.seconds for _, reply in replies)
    return sum(reply.usage.get("completion_tokens", 0) for _, reply in replies) / seconds if seconds else 0.0


def row(tally: AgentTally, alone: AgentTally) -> dict:
    replies = [reply for _, reply in tally.replies]
    steps = sum(reply.spec.get("num_spec_steps", 0) for reply in replies)
    accepted = sum(reply.spec.get("num_accepted_draft_tokens", 0) for reply in replies)
    prompt = sum(reply.usage.get("prompt_tokens", 0) for reply in replies)
    cached = sum((reply.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for reply in replies)
    ttft = statistics.median(reply.ttft for reply in replies)
    return {
        "config": tally.config, "requests": len(replies),
        "tokens": sum(reply.usage.get("completion_tokens", 0) for reply in replies),
        "tok_s": _rate(tally.replies), "vs_alone": _rate(tally.replies) / _rate(alone.replies),
        "answers_tok_s": _rate([r for r in tally.replies if r[0] == "answer"]),
        "ttft_p50_s": ttft, "ttft_vs_alone": ttft / statistics.median(r.ttft for _, r in alone.replies),
        "mal": 1 + accepted / steps if steps else None, "cached_share": cached / prompt if prompt else 0.0,
        "identical": sum(tally.transcripts[c] == alone.transcripts[c] for c in alone.transcripts),
        "conversations": len(alone.transcripts),
    }


def markdown(rows: list[dict], rtt_ms: float) -> str:
    lines = [f"Drafter link: {'loopback' if rtt_ms <= 0 else f'{rtt_ms:g} ms round trip'}.", "",
             "| configuration | tok/s | ÷ alone | answers tok/s | TTFT p50 ms (÷ alone) | MAL | cached | identical |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mal = "–" if r["mal"] is None else f"{r['mal']:.2f}"
        lines.append(f"| {r['config']} | {r['tok_s']:.1f} | {r['vs_alone']:.3f} | {r['answers_tok_s']:.1f} | "
                     f"{r['ttft_p50_s'] * 1000:.0f} ({r['ttft_vs_alone']:.2f}) | {mal} | {r['cached_share']:.0%} | "
                     f"{r['identical']}/{r['conversations']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", default="suffix,suffix+model", help="draft service drafters, as bench.network's")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--eagle-head", help=argparse.SUPPRESS)  # drafter_flags reads it
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="round trip between each target and its drafter")
    parser.add_argument("--max-tokens", type=int, default=96, help="the most tokens of an answer")
    parser.add_argument("--conversations", type=int, default=0, help="the first N of the set (0: all)")
    parser.add_argument("--file", type=Path, default=CONVERSATIONS)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "agent")
    args = parser.parse_args(argv)
    args.drafters = args.drafters.split(",")
    if unknown := [d for d in args.drafters if d.split("/")[0] not in DRAFTERS]:
        parser.error(f"--drafters: unknown {', '.join(unknown)}; choose from {', '.join(DRAFTERS)}")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    conversations = [json.loads(line) for line in args.file.read_text().splitlines() if line.strip()]
    conversations = conversations[:args.conversations or None]
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as logs:
        configs = start(args, Path(logs))
        try:
            for config in configs:  # a first conversation warms each up, unmeasured
                asyncio.run(converse(config, conversations[0], 8, AgentTally(config.name)))
            tallies = drive(configs, conversations, args.max_tokens)
        finally:
            for config in configs:
                config.stop()
    alone = tallies[ALONE]
    rows = [row(tally, alone) for tally in tallies.values()]
    table = markdown(rows, args.rtt_ms)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps({"argv": argv, "rows": rows}, indent=2))
    (args.out / "latest.md").write_text(table + "\n")
    return rows


if __name__ == "__main__":
    main()
