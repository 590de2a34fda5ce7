"""Tandem against llama.cpp's server on the same GGUF: the target alone, the pair and llama.cpp, in one run.

    python -m bench.versus_llamacpp [--llama-server PATH] [--threads 1,2] [--concurrency 1,8]
                                    [--num-prompts 8] [--kind chat] [--max-tokens 128] [--rounds 1]
                                    [--drafter suffix] [--out bench/results/versus_llamacpp]

llama.cpp is what a CPU user runs a GGUF with, so it is the bar. PATH (default $TANDEM_LLAMA_SERVER)
is llama.cpp's `llama-server`, built on this machine with GGML_NATIVE=ON (docs/benchmarks.md says
how); without it the comparison is skipped with a note.

Per thread count, every configuration is up at once: llama-server (8 slots, 1024 positions each),
Tandem's target alone on the GGUF's own blocks (--quantization auto), the target alone dequantized
to bf16 (--quantization none), and the pair (that target with the draft service's --drafter, one
thread). Tandem's KV cache holds the same 8 x 1024 positions. Every request is an OpenAI chat
completion over HTTP, streamed, greedy, with ignore_eos so that each engine writes exactly
--max-tokens; each group of requests (one prompt, or --concurrency at once) goes to every
configuration in turn, the order rotating, so that the machine's drift falls on all alike.

Reports tokens/s and its ratio to llama.cpp's, TTFT p50, and each configuration's resident memory
(VmRSS of its processes, after the run).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.http_client import chat_body, stream_chat
from bench.network import groups
from bench.prompt_set import KINDS, Prompt, load_prompts
from bench.serve import RESULTS_DIR, environment
from tandem.launch import ServiceProcess, free_port
from tandem.registry import DEFAULT_MODEL, resolve_model_path

LLAMA = "llama.cpp"
SLOTS = 8
SLOT_POSITIONS = 1024


@dataclass
class Server:
    """One configuration: its name, where its chat completions are, and its processes."""

    name: str
    url: str
    processes: list[subprocess.Popen]
    stop: list = field(default_factory=list)  # callables

    def resident_mb(self) -> float:
        return sum(_vm_rss_kb(p.pid) for p in self.processes) / 1024


@dataclass
class Cell:
    threads: int
    concurrency: int
    engine: str
    tokens: int = 0
    seconds: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _vm_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def start_llama_server(binary: Path, gguf: Path, threads: int, logs: Path) -> Server:
    port = free_port()
    log = (logs / f"llama-server-{threads}.log").open("w")
    process = subprocess.Popen(
        [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
         "-tb", str(threads), "-np", str(SLOTS), "-c", str(SLOTS * SLOT_POSITIONS), "--no-webui"],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"llama-server did not come up: see {log.name}")
        time.sleep(0.5)
    return Server(LLAMA, f"http://127.0.0.1:{port}/v1/chat/completions", [process], [process.terminate])


def start_tandem(name: str, threads: int, quantization: str, drafter: str, logs: Path) -> Server:
    draft = None
    flags = ["--model", DEFAULT_MODEL, "--threads", str(threads), "--quantization", quantization,
             "--max-num-seqs", str(SLOTS), "--max-model-len", str(SLOT_POSITIONS)]
    if drafter:
        draft = ServiceProcess("draft_service", ["--drafter", drafter, "--threads", "1"],
                               log_path=logs / f"draft-{threads}.log").start()
        flags += ["--drafter", draft.address]
    target = ServiceProcess("target_service", flags, http_port=free_port(),
                            log_path=logs / f"target-{name}-{threads}.log".replace(" ", "_")).start()
    services = [s for s in (target, draft) if s is not None]
    for service in services:
        service.wait_healthy(300)
    if draft is not None:
        target.wait_metric("tandem_drafter_connected", 1.0)
    return Server(name, f"{target.http_url}/chat/completions", [s.process for s in services],
                  [lambda s=s: s.terminate(10) for s in services])


async def run_group(engine: Server, batch: list[Prompt], max_tokens: int) -> tuple[float, list]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        bodies = [{**chat_body(p, DEFAULT_MODEL, 0.0, max_tokens, None, None), "ignore_eos": True} for p in batch]
        began = time.perf_counter()
        records = await asyncio.gather(*(stream_chat(session, engine.url, p, b, 0.0, 600)
                                         for p, b in zip(batch, bodies)))
        return time.perf_counter() - began, records


def drive(threads: int, concurrency: int, engines: list[Server], batches: list[list[Prompt]],
          max_tokens: int) -> list[Cell]:
    cells = {e.name: Cell(threads, concurrency, e.name) for e in engines}
    for g, batch in enumerate(batches):
        for engine in engines[g % len(engines):] + engines[:g % len(engines)]:
            seconds, records = asyncio.run(run_group(engine, batch, max_tokens))
            cell = cells[engine.name]
            cell.seconds += seconds
            cell.tokens += sum(r.completion_tokens for r in records)
            cell.ttfts += [r.ttft for r in records]
            cell.failures += [r.error for r in records if r.error]
        print(f"  threads={threads} c={concurrency} group {g + 1}/{len(batches)}: "
              + ", ".join(f"{c.engine} {c.tok_s:.1f}" for c in cells.values()), flush=True)
    return list(cells.values())


def run_threads(threads: int, args: argparse.Namespace, prompts: list[Prompt], logs: Path) -> tuple[list[Cell], dict]:
    engines: list[Server] = []
    try:
        engines.append(start_llama_server(args.llama_server, resolve_model_path(DEFAULT_MODEL), threads, logs))
        engines.append(start_tandem("tandem blocks", threads, "auto", "", logs))
        engines.append(start_tandem("tandem bf16", threads, "none", "", logs))
        engines.append(start_tandem(f"pair {args.drafter}", threads, "auto", args.drafter, logs))
        for engine in engines:  # warm: not measured
            asyncio.run(run_group(engine, prompts[:2], 16))
        cells = []
        for _ in range(args.rounds):
            for concurrency in args.concurrency:
                cells += drive(threads, concurrency, engines, groups(prompts, concurrency), args.max_tokens)
        return cells, {e.name: e.resident_mb() for e in engines}
    finally:
        for engine in engines:
            for stop in engine.stop:
                stop()


def merged(cells: list[Cell]) -> list[Cell]:
    """One cell per (threads, concurrency, engine), over rounds."""
    out: dict[tuple, Cell] = {}
    for c in cells:
        m = out.setdefault((c.threads, c.concurrency, c.engine), Cell(c.threads, c.concurrency, c.engine))
        m.tokens += c.tokens
        m.seconds += c.seconds
        m.ttfts += c.ttfts
        m.failures += c.failures
    return list(out.values())


def rows(cells: list[Cell], memory: dict[int, dict[str, float]]) -> list[dict]:
    llama = {(c.threads, c.concurrency): c for c in cells if c.engine == LLAMA}
    return [{"threads": c.threads, "concurrency": c.concurrency, "engine": c.engine, "tokens": c.tokens,
             "tok_s": c.tok_s, "vs_llama": c.tok_s / llama[c.threads, c.concurrency].tok_s,
             "ttft_p50_ms": statistics.median(c.ttfts) * 1e3 if c.ttfts else None,
             "resident_mb": memory[c.threads][c.engine], "failures": len(c.failures)} for c in cells]


def markdown(table: list[dict]) -> str:
    lines = ["| threads | at once | engine | tokens/s | ÷ llama.cpp | TTFT p50 | resident MB |",
             "|---|---|---|---|---|---|---|"]
    for r in table:
        failed = f" ({r['failures']} failed)" if r["failures"] else ""
        lines.append(f"| {r['threads']} | {r['concurrency']} | {r['engine']}{failed} | {r['tok_s']:.1f} | "
                     f"{r['vs_llama']:.2f} | {r['ttft_p50_ms']:.0f} ms | {r['resident_mb']:.0f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", type=Path, default=os.environ.get("TANDEM_LLAMA_SERVER", ""))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--kind", default="chat", choices=KINDS)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--drafter", default="suffix", help="the pair's draft service --drafter")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "versus_llamacpp")
    args = parser.parse_args(argv)
    args.threads = [int(n) for n in args.threads.split(",")]
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if not args.llama_server or not Path(args.llama_server).is_file():
        print("skipped: no llama-server (pass --llama-server or set TANDEM_LLAMA_SERVER; docs/benchmarks.md)")
        return []
    prompts = [p for p in load_prompts() if p.kind == args.kind][:args.num_prompts]
    logs = Path(tempfile.mkdtemp(prefix="versus-llamacpp-"))
    cells, memory = [], {}
    for threads in args.threads:
        found, memory[threads] = run_threads(threads, args, prompts, logs)
        cells += found
    table = rows(merged(cells), memory)
    print(markdown(table))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"environment": environment(), "rows": table}, indent=1))
    (args.out / "results.md").write_text(markdown(table) + "\n")
    print(f"logs: {logs}")
    return table


if __name__ == "__main__":
    main()
