"""The CUDA checks of issue 13 in one run of a few minutes: `make gpu-check`.

1. The `-m gpu` tests, by pytest in a subprocess: pass or fail, the run goes on.
2. The device's copy bandwidth: a large tensor copied, (read + written bytes) / time.
3. Decode (1 token per sequence) and verify (k+1 = 5 tokens) steps of a random-weight
   Llama-3.2-1B-shaped target in bf16, at batch 1 and 16, with CUDA graphs and without, against
   the bandwidth bound: bytes a step must stream (weights + the KV it reads) / bandwidth.

It prints a table and writes it as JSON (--out), after each part, so a crash keeps what came
before. Each part catches its own errors, prints them and goes on; the exit status is 1 if a test
failed or a part raised. It imports only torch and tandem.model (no grpc, tokenizers or gguf), so
the GPU machine's system python runs it without the project's venv:

    PYTHONPATH=. python3 -m bench.gpu_check [--out bench/results/gpu_check.json]
    python -m bench.gpu_check --device cpu --shape tiny --no-tests --steps 3   # its code paths on CPU

On CPU, "graphs" rows run the same static-shape forward eagerly.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from tandem.cli_args import add_dataclass_flags, dataclass_from_args
from tandem.model.batch import SequenceChunk
from tandem.model.llama import LlamaModel, ModelWeights, build_model
from tandem.model.random_weights import SHAPES, random_weights

ROOT = Path(__file__).resolve().parents[1]
BATCH_SIZES = (1, 16)
WARMUP_STEPS = 4  # the first one captures the graph
DTYPE = torch.bfloat16


@dataclass(slots=True)
class GpuCheckConfig:
    out: str = "bench/results/gpu_check.json"
    device: str = "cuda"
    shape: str = "llama-3.2-1b"
    prompt_len: int = 512  # context per sequence before the timed steps
    steps: int = 64  # timed steps per row
    verify_tokens: int = 5  # k + 1
    tests: bool = True
    test_timeout_s: int = 300
    budget_s: int = 420  # no part starts after this: the whole run stays under 8 minutes


@dataclass(slots=True)
class StepRow:
    path: str  # "graphs" (static shapes, CUDA graphs on CUDA) or "eager" (the dynamic path)
    step: str  # "decode" or "verify"
    batch: int
    tokens_per_step: int  # batch * tokens per sequence
    ms_per_step: float
    tokens_per_s: float  # tokens scored per second (for verify: drafts + bonus, before acceptance)
    mb_per_step: float  # weights + KV read
    bound_ms: float  # mb_per_step / bandwidth
    percent_of_bound: float  # bound_ms / ms_per_step


@dataclass(slots=True)
class Report:
    device: str
    torch: str
    triton: str
    shape: str
    dtype: str = "bfloat16"
    tests: dict[str, Any] = field(default_factory=dict)
    bandwidth_gb_s: float | None = None
    rows: list[StepRow] = field(default_factory=list)
    graphs_captured: int | None = None
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_flags(parser, GpuCheckConfig)
    config = dataclass_from_args(GpuCheckConfig, parser.parse_args(argv))
    start = time.perf_counter()
    report = Report(device=_device_name(config.device), torch=torch.__version__, triton=_triton_version(),
                    shape=config.shape)
    out = Path(config.out)
    print(f"gpu-check on {report.device}: torch {report.torch}, triton {report.triton}", flush=True)

    def part(name: str, fn: Callable[[], None]) -> None:
        if time.perf_counter() - start > config.budget_s:
            report.errors.append(f"{name}: skipped, past the {config.budget_s} s budget")
            print(report.errors[-1], flush=True)
            return
        print(f"== {name}", flush=True)
        try:
            fn()
        except Exception as error:  # a part's failure is reported, and the next part runs
            traceback.print_exc(limit=-8)
            report.errors.append(f"{name}: {type(error).__name__}: {error}")
        report.seconds = round(time.perf_counter() - start, 1)
        _write(report, out)

    if config.tests:
        part("tests", lambda: report.tests.update(run_gpu_tests(config.test_timeout_s)))
    part("bandwidth", lambda: _measure_bandwidth(report, torch.device(config.device)))
    part("steps", lambda: run_step_rows(config, report, start))
    print(format_table(report), flush=True)
    print(f"wrote {out} ({report.seconds} s)", flush=True)
    failed = bool(report.errors) or report.tests.get("returncode", 0) != 0
    return 1 if failed else 0


def _device_name(device: str) -> str:
    if device != "cuda":
        return device
    try:
        return torch.cuda.get_device_name()
    except Exception as error:  # no usable device: the parts will say what fails
        return f"cuda unavailable ({type(error).__name__}: {error})"


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def _write(report: Report, out: Path) -> None:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(asdict(report), indent=2) + "\n")
    except OSError as error:  # the printed table still carries the results
        print(f"could not write {out}: {error}", flush=True)


def _measure_bandwidth(report: Report, device: torch.device) -> None:
    report.bandwidth_gb_s = copy_bandwidth_gb_s(device)
    print(f"copy bandwidth: {report.bandwidth_gb_s:.0f} GB/s", flush=True)


GPU_MARKS = ("mark.gpu", "triton_devices(")  # a gpu mark, or the Triton device params (tests/support/devices.py)


def gpu_test_files() -> list[str]:
    """The test files that hold `gpu` tests: naming them keeps pytest from importing the rest
    (grpc, tokenizers), which the GPU machine may lack."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if any(mark in p.read_text() for mark in GPU_MARKS))


def run_gpu_tests(timeout_s: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", *gpu_test_files()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    print("$ " + " ".join(command), flush=True)
    started = time.perf_counter()
    try:
        run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as timeout:
        tail = _text(timeout.stdout)[-3000:]
        print(tail, flush=True)
        return {"returncode": -1, "summary": f"timed out after {timeout_s} s", "seconds": timeout_s}
    output = run.stdout + run.stderr
    print(output[-6000:], flush=True)
    lines = [line for line in output.splitlines() if line.strip()]
    summary = next((line.strip("= ") for line in reversed(lines) if " in " in line and any(
        word in line for word in ("passed", "failed", "error", "skipped", "deselected"))), "no summary line")
    return {"returncode": run.returncode, "summary": summary, "seconds": round(time.perf_counter() - started, 1)}


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def copy_bandwidth_gb_s(device: torch.device, repeats: int = 20) -> float:
    """(read + written bytes) / time of copying one large buffer into another."""
    nbytes = (2 << 30) if device.type == "cuda" else (64 << 20)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    seconds = _timed(device, lambda: target.copy_(source), repeats)
    return 2 * nbytes / seconds / 1e9


def _timed(device: torch.device, fn: Callable[[], Any], repeats: int) -> float:
    """Seconds per call of fn, everything it queued on the device finished."""
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    _synchronize(device)
    return (time.perf_counter() - started) / repeats


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step_rows(config: GpuCheckConfig, report: Report, start: float) -> None:
    """Eager rows first: if a graph capture goes wrong, their figures are already in."""
    device = torch.device(config.device)
    model_config = SHAPES[config.shape]
    weights = random_weights(model_config, seed=0, dtype=DTYPE, device=device)
    max_len = config.prompt_len + (WARMUP_STEPS + config.steps) * config.verify_tokens + 1
    print(format_header(), flush=True)
    for path, graphs in (("eager", False), ("graphs", True)):
        # Both built from the same device tensors: build_model does not copy them.
        model = build_model(model_config, weights, dtype=DTYPE, device=device, num_slots=max(BATCH_SIZES),
                            max_model_len=max_len, backend="torch", cuda_graphs=graphs)
        _prefill(model, config.prompt_len)
        for step, tokens in (("decode", 1), ("verify", config.verify_tokens)):
            for batch in BATCH_SIZES:
                if time.perf_counter() - start > config.budget_s:
                    report.errors.append(f"{path} {step} batch {batch}: skipped, past the budget")
                    continue
                try:
                    row = time_steps(model, weights, config, path, step, tokens, batch, report.bandwidth_gb_s)
                except Exception as error:  # one row's failure leaves the others to run
                    traceback.print_exc(limit=-8)
                    report.errors.append(f"{path} {step} batch {batch}: {type(error).__name__}: {error}")
                    continue
                report.rows.append(row)
                print(format_row(row), flush=True)
        if graphs:
            report.graphs_captured = model.decoder.static_steps.num_graphs
        del model


def _prefill(model: LlamaModel, prompt_len: int) -> None:
    """Every slot holds a prompt of prompt_len tokens (the dynamic path: one sequence per forward)."""
    vocab = model.config.vocab_size
    for slot in range(model.kv_cache.num_slots):
        ids = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(slot)).tolist()
        model.run([SequenceChunk(slot, 0, ids)])


def time_steps(model: LlamaModel, weights: ModelWeights, config: GpuCheckConfig, path: str, step: str,
               tokens: int, batch: int, bandwidth_gb_s: float | None) -> StepRow:
    """Steps from prompt_len on, each a whole greedy step: forward, then the argmax on the host."""
    ids = [i % model.config.vocab_size for i in range(1000, 1000 + tokens)]
    plan = [[SequenceChunk(slot, config.prompt_len + i * tokens, ids, num_logits=tokens) for slot in range(batch)]
            for i in range(WARMUP_STEPS + config.steps)]
    for chunks in plan[:WARMUP_STEPS]:
        model.greedy_tokens(model.run(chunks))
    timed = iter(plan[WARMUP_STEPS:])
    seconds = _timed(model.device, lambda: model.greedy_tokens(model.run(next(timed))), config.steps)
    # Keys read per sequence, averaged over the timed steps: everything up to the step's last token.
    mean_keys = config.prompt_len + (WARMUP_STEPS + (config.steps - 1) / 2) * tokens + tokens
    megabytes = (weight_bytes(weights) + batch * kv_bytes_per_key(model) * mean_keys) / 1e6
    bound_ms = megabytes / 1e3 / bandwidth_gb_s * 1e3 if bandwidth_gb_s else float("nan")
    return StepRow(path, step, batch, batch * tokens, round(seconds * 1e3, 3), round(batch * tokens / seconds, 1),
                   round(megabytes, 1), round(bound_ms, 3), round(100 * bound_ms / (seconds * 1e3), 1))


def weight_bytes(weights: ModelWeights) -> int:
    """What one forward streams from the weights: every layer, the final norm and the lm_head
    (the embedding rows it looks up are negligible; a tied lm_head is the embedding, counted once)."""
    layers = sum(t.numel() * t.element_size() for layer in weights.layers
                 for t in (getattr(layer, name) for name in type(layer).__slots__) if t is not None)
    return layers + sum(t.numel() * t.element_size() for t in (weights.norm, weights.lm_head))


def kv_bytes_per_key(model: LlamaModel) -> int:
    """K and V of one position of one sequence, all layers."""
    return model.kv_cache.bytes_per_token()


HEADER = ("path", "step", "batch", "tok/step", "ms/step", "tok/s", "MB/step", "bound ms", "% of bound")


def format_header() -> str:
    return " | ".join(f"{h:>10}" for h in HEADER)


def format_row(row: StepRow) -> str:
    values = (row.path, row.step, row.batch, row.tokens_per_step, f"{row.ms_per_step:.3f}",
              f"{row.tokens_per_s:.0f}", f"{row.mb_per_step:.0f}", f"{row.bound_ms:.3f}", f"{row.percent_of_bound:.0f}")
    return " | ".join(f"{v!s:>10}" for v in values)


def format_table(report: Report) -> str:
    bandwidth = "not measured" if report.bandwidth_gb_s is None else f"{report.bandwidth_gb_s:.0f} GB/s"
    lines = [
        f"tests: {report.tests.get('summary', 'not run')}",
        f"copy bandwidth: {bandwidth}; {report.shape} random weights in {report.dtype}; "
        f"graphs captured: {report.graphs_captured}",
        format_header(),
        *(format_row(row) for row in report.rows),
        *(f"error: {e}" for e in report.errors),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
