"""The front doors against each other, in one run: gRPC Generation, OpenAI HTTP, and HTTP through the
Shepherd Model Gateway (smg) in front of the same target.

    python -m bench.front_doors                       # c=1 and c=16, 32 prompts, 64 tokens, 3 rounds
    python -m bench.front_doors --aiperf aiperf       # also aiperf against the HTTP front (bench/README.md)

The same chat prompts go through each door, greedy, so every door generates the same tokens and
the figures differ only by what the door costs. Doors alternate chunk by chunk, so that a noisy
box hits all alike. Speculation is off by default (--speculate turns it on with the n-gram
drafter): the drafter's acceptance would only add noise to a comparison of front doors.
Writes bench/results/front_doors.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path


from bench.http_client import run_http_load
from bench.load import Arrivals, RequestRecord, run_load
from bench.prompt_set import Prompt, load_prompts
from bench.stats import ratio, summarize
from tandem.launch import GatewayProcess, ServiceProcess, free_port
from tandem.registry import DEFAULT_MODEL
from tandem.runtime import load_tokenizer, tokenizer_path

RESULTS = Path(__file__).parent / "results" / "front_doors.json"
DOORS = ("grpc", "http", "gateway")


@dataclass(slots=True)
class FrontDoorConfig:
    concurrency: list[int] = field(default_factory=lambda: [1, 16])
    num_prompts: int = 32
    max_tokens: int = 64
    rounds: int = 3
    speculate: bool = False
    gateway: bool = True
    aiperf: str = ""  # the aiperf command; empty skips it
    out: str = str(RESULTS)


@dataclass
class Stack:
    target: ServiceProcess
    draft: ServiceProcess | None
    gateway: GatewayProcess | None

    @classmethod
    def start(cls, config: FrontDoorConfig, logs: Path) -> "Stack":
        slots = max(config.concurrency)
        draft = None
        args = ["--threads", "1", "--max-model-len", "1024", "--max-num-seqs", str(slots), "--max-queue", "256"]
        if config.speculate:
            draft = ServiceProcess("draft_service", ["--drafter", "ngram", "--threads", "1"],
                                   log_path=logs / "draft.log").start()
            args += ["--drafter", draft.address]
        target = ServiceProcess("target_service", args, log_path=logs / "target.log", http_port=free_port()).start()
        stack = cls(target, draft, None)
        try:
            target.wait_healthy(300)
            if draft is not None:
                target.wait_metric("tandem_drafter_connected", 1)
            if config.gateway:
                stack.gateway = GatewayProcess([target.address], logs / "smg.log").start().wait_ready(DEFAULT_MODEL)
        except BaseException:
            stack.stop()
            raise
        return stack

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.kill()
        self.target.terminate(10)
        if self.draft is not None:
            self.draft.terminate(10)


def run_door(stack: Stack, door: str, prompts: list[Prompt], concurrency: int, config: FrontDoorConfig):
    arrivals = Arrivals("closed", concurrency)
    speculate = None if config.speculate else False
    if door == "grpc":
        return asyncio.run(run_load(stack.target.address, prompts, arrivals, temperature=0.0,
                                    max_tokens=config.max_tokens, speculate=speculate))
    base = stack.gateway.url if door == "gateway" else stack.target.http_url.removesuffix("/v1")
    # The gateway refuses fields it does not know, Tandem's `speculate` among them: leave it to the server.
    return asyncio.run(run_http_load(f"{base}/v1/chat/completions", DEFAULT_MODEL, prompts, arrivals,
                                     temperature=0.0, max_tokens=config.max_tokens,
                                     speculate=None if door == "gateway" else speculate))


def _chunks(prompts: list[Prompt], n: int) -> list[list[Prompt]]:
    size = -(-len(prompts) // n)
    return [prompts[i:i + size] for i in range(0, len(prompts), size)]


def compare(config: FrontDoorConfig, stack: Stack, prompts: list[Prompt]) -> dict:
    doors = [d for d in DOORS if d != "gateway" or stack.gateway is not None]
    rows = {}
    for concurrency in config.concurrency:
        records: dict[str, list[RequestRecord]] = {d: [] for d in doors}
        durations = {d: 0.0 for d in doors}
        for door in doors:  # warm-up, out of the figures
            run_door(stack, door, prompts[:2], 2, config)
        for chunk in _chunks(prompts, config.rounds):
            for door in doors:
                result = run_door(stack, door, chunk, concurrency, config)
                records[door] += result.records
                durations[door] += result.duration
        summaries = {d: summarize(records[d], durations[d]) for d in doors}
        rows[f"c={concurrency}"] = summaries
        _print_row(concurrency, summaries)
    return rows


def _print_row(concurrency: int, summaries: dict) -> None:
    grpc = summaries["grpc"]
    for door, s in summaries.items():
        ttft = s["ttft_s"]["p50"]
        line = (f"c={concurrency:<3} {door:8} tok/s {s['throughput_tok_s']:7.1f}  TTFT p50 {ttft * 1000:6.1f} ms  "
                f"tokens {s['output_tokens']}  errors {s['errors']}")
        if door != "grpc":
            line += (f"  | ÷ grpc {ratio(s['throughput_tok_s'], grpc['throughput_tok_s']):.3f}, "
                     f"TTFT {(ttft - grpc['ttft_s']['p50']) * 1000:+.1f} ms")
        if door == "gateway":
            line += f"  | ÷ http {ratio(s['throughput_tok_s'], summaries['http']['throughput_tok_s']):.3f}"
        print(line, flush=True)


def run_aiperf(config: FrontDoorConfig, stack: Stack, prompts: list[Prompt], workdir: Path) -> dict:
    """aiperf against the HTTP front, beside bench.load over gRPC, on the same single-message prompts."""
    tokenizer_dir = workdir / "tokenizer"
    tokenizer_dir.mkdir(exist_ok=True)
    for name, text in load_tokenizer(tokenizer_path(DEFAULT_MODEL)).hf_files().items():
        (tokenizer_dir / name).write_text(text)
    inputs = workdir / "aiperf_inputs.jsonl"
    inputs.write_text("".join(json.dumps({"text": p.messages[-1][1], "output_length": config.max_tokens}) + "\n"
                              for p in prompts))
    single = [Prompt(p.id, p.kind, (p.messages[-1],)) for p in prompts]
    rows = {}
    for concurrency in config.concurrency:
        artifacts = workdir / f"aiperf-c{concurrency}"
        command = [config.aiperf, "profile", "--model", DEFAULT_MODEL, "--url",
                   stack.target.http_url.removesuffix("/v1"), "--endpoint-type", "chat", "--streaming",
                   "--concurrency", str(concurrency), "--request-count", str(len(prompts)),
                   "--input-file", str(inputs), "--custom-dataset-type", "single_turn",
                   "--dataset-sampling-strategy", "sequential", "--tokenizer", str(tokenizer_dir),
                   "--use-server-token-count", "--extra-inputs", "temperature:0", "--extra-inputs",
                   f"max_tokens:{config.max_tokens}", "--ui-type", "none", "--no-server-metrics",
                   "--output-artifact-dir", str(artifacts)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        [export] = artifacts.rglob("profile_export_aiperf.json")
        report = json.loads(export.read_text())
        grpc = asyncio.run(run_load(stack.target.address, single, Arrivals("closed", concurrency), temperature=0.0,
                                    max_tokens=config.max_tokens, speculate=None if config.speculate else False))
        ours = summarize(grpc.records, grpc.duration)
        rows[f"c={concurrency}"] = {
            "aiperf_http": {"ttft_ms_p50": report["time_to_first_token"]["p50"],
                            "itl_ms_p50": report["inter_token_latency"]["p50"],
                            "output_tok_s": report["output_token_throughput"]["avg"]},
            "bench_load_grpc": {"ttft_ms_p50": ours["ttft_s"]["p50"] * 1000,
                                "tpot_ms_p50": ours["tpot_s"]["p50"] * 1000,
                                "output_tok_s": ours["throughput_tok_s"]},
        }
        print(f"c={concurrency:<3} aiperf over HTTP: {rows[f'c={concurrency}']['aiperf_http']}\n"
              f"      bench.load over gRPC: {rows[f'c={concurrency}']['bench_load_grpc']}", flush=True)
    return rows


def parse_config(argv: list[str] | None = None) -> FrontDoorConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = FrontDoorConfig()
    parser.add_argument("--concurrency", type=int, nargs="+", default=defaults.concurrency)
    parser.add_argument("--num-prompts", type=int, default=defaults.num_prompts)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--speculate", action="store_true", help="with the n-gram drafter")
    parser.add_argument("--no-gateway", dest="gateway", action="store_false")
    parser.add_argument("--aiperf", default="", help="the aiperf command (bench/README.md installs it)")
    parser.add_argument("--out", default=defaults.out)
    return FrontDoorConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(argv)
    prompts = load_prompts(config.num_prompts)
    with tempfile.TemporaryDirectory(prefix="tandem-front-doors-") as tmp:
        workdir = Path(tmp)
        stack = Stack.start(config, workdir)
        try:
            report = {"config": asdict(config), "doors": compare(config, stack, prompts)}
            if config.aiperf:
                report["aiperf"] = run_aiperf(config, stack, prompts, workdir)
        finally:
            stack.stop()
    Path(config.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
