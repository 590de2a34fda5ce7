"""Tandem against the target alone, synchronous speculation and HF transformers, in one run.

    python -m bench.serve            # the short version (a few minutes on a 2-core box)
    python -m bench.serve --full     # the long one: every prompt, concurrency 1/4/16, both drafters
                                     # (model: the distilled smollm2-135m-draft; ngram: prompt lookup)

Modes, on the same prompts, interleaved round by round so that a noisy machine hits all alike:
  alone  the target with speculation off (SamplingParams.speculate=False, same process as async)
  async  Tandem's default, non-blocking speculation
  sync   a second target started with --sync-speculation (waits for the drafter every step)
  hf     HF transformers in-process, `generate` alone (greedy only, one request after another)
  hf_ngram / hf_model  HF prompt lookup / assisted generation with the same model pair
Writes bench/results/latest.json (every request and every summary), latest.md (the README's tables)
and one PNG per drafter.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.load import Arrivals, RequestRecord, RunResult, run_load
from bench.markdown import results_markdown
from bench.prompt_set import KINDS, Prompt, kinds_with_data, load_prompts
from bench.scrape import counters, delta, server_summary
from bench.stats import ratio, summarize
from tandem.launch import ServiceProcess
from tandem.registry import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL

RESULTS_DIR = Path(__file__).parent / "results"
TANDEM_MODES = ("alone", "async", "sync")


DRAFTERS = ("ngram", "model", "suffix", "suffix+model")  # the draft service's --drafter kinds
EAGLE3 = "eagle3"  # the draft service's kind for an EAGLE-3 head, which names its target


def eagle3_drafter_flags(head: str, target: str) -> list[str]:
    """The draft service's flags to serve an EAGLE-3 head folder for `target`."""
    return ["--drafter", EAGLE3, "--model", head, "--drafter-target", target]


# --full: every prompt (0 = all), longer answers, concurrency 16, both drafters, open loop at both T.
FULL_DEFAULTS = {"num_prompts": 0, "max_tokens": 128, "concurrency": [1, 4, 16], "drafters": ["ngram", "model"],
                 "open_loop_temperatures": [0.0, 0.7]}


@dataclass(slots=True)
class BenchConfig:
    full: bool = False
    num_prompts: int = 16
    max_tokens: int = 48
    concurrency: list[int] = field(default_factory=lambda: [1, 4])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    rate: float = 2.0  # open loop, requests/s; 0 skips it
    open_loop_temperatures: list[float] = field(default_factory=lambda: [0.0])
    drafters: list[str] = field(default_factory=lambda: ["model"])
    num_speculative_tokens: int = 4
    rounds: int = 2  # the prompts are split in this many chunks; modes alternate chunk by chunk
    hf: bool = True
    hf_threads: int = 1  # as the target's --threads: one core for the model
    model: str = DEFAULT_MODEL
    draft_model: str = DEFAULT_DRAFT_MODEL  # the model drafter's model: the distilled drafter
    seed: int = 0
    out: str = str(RESULTS_DIR)

    def __post_init__(self) -> None:
        if self.num_prompts < 0 or self.max_tokens < 1 or self.rounds < 1 or min(self.concurrency) < 1:
            raise ValueError("--num-prompts >= 0, --max-tokens >= 1, --rounds >= 1, --concurrency >= 1")
        if bad := set(self.drafters) - set(DRAFTERS):
            raise ValueError(f"--drafters takes {', '.join(DRAFTERS)}, got {sorted(bad)}")

    @property
    def max_concurrency(self) -> int:
        return max(self.concurrency)


# ---- services ---------------------------------------------------------------------------------

@dataclass
class Pair:
    """One draft service, and two targets connected to it: async (also serves `alone`) and sync."""

    draft: ServiceProcess
    targets: dict[str, ServiceProcess]  # "async", "sync"

    @classmethod
    def start(cls, config: BenchConfig, drafter: str, logs: Path) -> "Pair":
        slots = config.max_concurrency
        common = ["--threads", "1", "--max-model-len", "1024"]
        draft_model = config.draft_model if "model" in drafter else config.model  # lookups: its tokenizer
        draft = ServiceProcess("draft_service", [*common, "--model", draft_model, "--drafter", drafter,
                                                 "--num-slots", str(2 * slots),
                                                 "--max-k", str(max(8, config.num_speculative_tokens))],
                               log_path=logs / f"draft-{drafter}.log").start()
        target_args = [*common, "--model", config.model, "--drafter", draft.address, "--max-num-seqs", str(slots),
                       "--max-queue", str(max(64, 2 * slots)),
                       "--num-speculative-tokens", str(config.num_speculative_tokens)]
        targets = {
            "async": ServiceProcess("target_service", target_args, log_path=logs / f"target-async-{drafter}.log"),
            "sync": ServiceProcess("target_service", [*target_args, "--sync-speculation"],
                                   log_path=logs / f"target-sync-{drafter}.log"),
        }
        pair = cls(draft, targets)
        try:
            for t in targets.values():
                t.start()
            draft.wait_healthy(300)
            for t in targets.values():
                t.wait_healthy(300)
                t.wait_metric("tandem_drafter_connected", 1.0)
        except BaseException:
            pair.stop()
            raise
        return pair

    def target_for(self, mode: str) -> ServiceProcess:
        return self.targets["sync" if mode == "sync" else "async"]

    def stop(self) -> None:
        for t in self.targets.values():
            t.terminate(10)
        self.draft.terminate(10)


# ---- one cell: a mode at a temperature under one arrival pattern -------------------------------

@dataclass
class ServeCell:
    drafter: str
    mode: str
    temperature: float
    arrivals: Arrivals
    records: list[RequestRecord] = field(default_factory=list)
    duration: float = 0.0
    server: dict[str, float] = field(default_factory=dict)

    def add(self, result: RunResult, server_delta: dict[str, float] | None) -> None:
        self.records += result.records
        self.duration += result.duration
        for k, v in (server_delta or {}).items():
            self.server[k] = self.server.get(k, 0.0) + v

    def to_json(self) -> dict:
        return {
            "drafter": self.drafter, "mode": self.mode, "temperature": self.temperature,
            "arrivals": asdict(self.arrivals), "label": self.arrivals.label,
            "summary": summarize(self.records, self.duration),
            "server": server_summary(self.server) if self.server else None,
            "records": [r.to_json() for r in self.records],
        }


def _chunks(prompts: list[Prompt], n: int) -> list[list[Prompt]]:
    size = -(-len(prompts) // n)
    return [prompts[i:i + size] for i in range(0, len(prompts), size)]


def run_tandem_chunk(config: BenchConfig, target: ServiceProcess, mode: str, prompts: list[Prompt],
                     arrivals: Arrivals, temperature: float, offset: int) -> tuple[RunResult, dict[str, float]]:
    before = counters(target.metrics_url)
    result = asyncio.run(run_load(target.address, prompts, arrivals, temperature=temperature,
                                  max_tokens=config.max_tokens, speculate=(mode != "alone"),
                                  seed=config.seed + offset))
    return result, delta(before, counters(target.metrics_url))


def warm_up(config: BenchConfig, pair: Pair, prompts: list[Prompt]) -> None:
    """The first requests of a process pay for lazy initialisation: keep them out of the figures."""
    for mode in TANDEM_MODES:
        for temperature in sorted(set(config.temperatures)):
            asyncio.run(run_load(pair.target_for(mode).address, prompts[:3], Arrivals("closed", 3),
                                 temperature=temperature, max_tokens=min(8, config.max_tokens),
                                 speculate=(mode != "alone")))


def run_drafter(config: BenchConfig, drafter: str, prompts: list[Prompt], hf, logs: Path) -> list[ServeCell]:
    print(f"\n== drafter {drafter}: starting the draft service and two targets ...", flush=True)
    pair = Pair.start(config, drafter, logs)
    cells: list[ServeCell] = []
    try:
        warm_up(config, pair, prompts)
        patterns = [(t, Arrivals("closed", c)) for t in config.temperatures for c in config.concurrency]
        if config.rate > 0:
            patterns += [(t, Arrivals("open", rate=config.rate, seed=config.seed))
                         for t in config.open_loop_temperatures]
        # HF has prompt lookup and assisted generation, no suffix decoding.
        hf_modes = ["hf", *([f"hf_{drafter}"] if drafter in ("ngram", "model") else [])] if hf is not None else []
        for temperature, arrivals in patterns:
            with_hf = hf_modes if (temperature == 0 and arrivals == Arrivals("closed", 1)) else []
            modes = [*TANDEM_MODES, *with_hf]
            group = {m: ServeCell(drafter, m, temperature, arrivals) for m in modes}
            offset = 0
            for r, chunk in enumerate(_chunks(prompts, config.rounds)):
                order = modes[r % len(modes):] + modes[:r % len(modes)]  # rotate: no mode always goes first
                for mode in order:
                    if mode.startswith("hf"):
                        result = hf.run(chunk, config.max_tokens, None if mode == "hf" else drafter,
                                        config.num_speculative_tokens)
                        group[mode].add(result, None)
                    else:
                        result, server = run_tandem_chunk(config, pair.target_for(mode), mode, chunk, arrivals,
                                                          temperature, offset)
                        group[mode].add(result, server)
                offset += len(chunk)
            for cell in group.values():
                print(format_row(cell.to_json()), flush=True)
            cells += group.values()
    finally:
        pair.stop()
    return cells


# ---- reporting --------------------------------------------------------------------------------

HEADER = (f"{'drafter':<12} {'mode':<8} {'T':>3} {'load':<10} {'TTFT p50/p90/p99 ms':>21} {'TPOT p50/p90 ms':>16} "
          f"{'ITL p50':>7} {'e2e p50 s':>9} {'tok/s':>6} {'accept':>6} {'MAL':>5} {'miss':>5} {'err':>3}")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_row(cell: dict) -> str:
    s, server = cell["summary"], cell["server"] or {}
    ttft, tpot = s["ttft_s"], s["tpot_s"]
    acc = s["acceptance"]
    return (f"{cell['drafter']:<12} {cell['mode']:<8} {cell['temperature']:>3g} {cell['label']:<10} "
            f"{_ms(ttft['p50']) + '/' + _ms(ttft['p90']) + '/' + _ms(ttft['p99']):>21} "
            f"{_ms(tpot['p50']) + '/' + _ms(tpot['p90']):>16} {_ms(s['itl_s']['p50']):>7} "
            f"{_num(s['e2e_s']['p50'], '.2f'):>9} {_num(s['throughput_tok_s'], '.1f'):>6} "
            f"{_num(acc['acceptance_rate'], '.0%'):>6} {_num(acc['mean_acceptance_length'], '.2f'):>5} "
            f"{_num(server.get('draft_miss_rate'), '.0%'):>5} {s['errors']:>3}")


def compute_ratios(cells: list[dict]) -> list[dict]:
    """The ratios the issue asks for, from cells of the same run."""
    index = {(c["drafter"], c["mode"], c["temperature"], c["label"]): c["summary"] for c in cells}
    rows = []
    for drafter, temperature, label in sorted({(c["drafter"], c["temperature"], c["label"]) for c in cells}):
        get = {m: index.get((drafter, m, temperature, label)) for m in TANDEM_MODES}
        if None in get.values():
            continue

        def p50(mode: str, figure: str) -> float | None:
            return get[mode][figure]["p50"]

        def tput(mode: str) -> float | None:
            return get[mode]["throughput_tok_s"]

        rows.append({
            "drafter": drafter, "temperature": temperature, "load": label,
            "ttft_p50_async_over_alone": ratio(p50("async", "ttft_s"), p50("alone", "ttft_s")),
            "ttft_p50_sync_over_alone": ratio(p50("sync", "ttft_s"), p50("alone", "ttft_s")),
            "tpot_p50_async_over_alone": ratio(p50("async", "tpot_s"), p50("alone", "tpot_s")),
            "tpot_p50_sync_over_alone": ratio(p50("sync", "tpot_s"), p50("alone", "tpot_s")),
            "tpot_p50_async_over_sync": ratio(p50("async", "tpot_s"), p50("sync", "tpot_s")),
            "throughput_async_over_alone": ratio(tput("async"), tput("alone")),
            "throughput_sync_over_alone": ratio(tput("sync"), tput("alone")),
            "throughput_async_over_sync": ratio(tput("async"), tput("sync")),
        })
    return rows


def compute_hf_ratios(cells: list[dict], concurrency: list[int]) -> list[dict]:
    """Tandem's tokens/s at concurrency c over HF's, which serves one request after another at any c."""
    index = {(c["drafter"], c["mode"], c["temperature"], c["label"]): c["summary"] for c in cells}
    rows = []
    for drafter in sorted({c["drafter"] for c in cells}):
        hf = index.get((drafter, "hf", 0.0, "c=1"))
        hf_spec = index.get((drafter, f"hf_{drafter}", 0.0, "c=1"))
        if hf is None:
            continue
        for c in sorted({1, max(concurrency)}):
            for mode in TANDEM_MODES:
                tandem = index.get((drafter, mode, 0.0, f"c={c}"))
                if tandem is None:
                    continue
                rows.append({
                    "drafter": drafter, "load": f"c={c}", "tandem_mode": mode,
                    "tandem_tok_s": tandem["throughput_tok_s"], "hf_tok_s": hf["throughput_tok_s"],
                    "hf_spec_tok_s": hf_spec["throughput_tok_s"] if hf_spec else None,
                    "tandem_over_hf": ratio(tandem["throughput_tok_s"], hf["throughput_tok_s"]),
                    "tandem_over_hf_spec": ratio(tandem["throughput_tok_s"],
                                                 hf_spec["throughput_tok_s"] if hf_spec else None),
                })
    return rows


def acceptance_by_kind(cells: list[dict]) -> list[dict]:
    """Acceptance of async and sync per prompt kind, pooled over loads, per drafter and temperature."""
    rows = []
    keys = sorted({(c["drafter"], c["mode"], c["temperature"]) for c in cells if c["mode"] in ("async", "sync")})
    for drafter, mode, temperature in keys:
        group = [c for c in cells if (c["drafter"], c["mode"], c["temperature"]) == (drafter, mode, temperature)]
        row = {"drafter": drafter, "mode": mode, "temperature": temperature}
        for kind in KINDS:
            recs = [r for c in group for r in c["records"] if r["kind"] == kind and not r["error"]]
            draft = sum(r["draft_tokens"] for r in recs)
            acc = sum(r["accepted_tokens"] for r in recs)
            steps = sum(r["draft_steps"] for r in recs)
            row[kind] = {"acceptance_rate": acc / draft if draft else None,
                         "mean_acceptance_length": 1 + acc / steps if steps else None}
        miss = sum(c["server"]["draft_miss"] for c in group if c["server"])
        drafts = sum(c["server"]["drafts"] for c in group if c["server"])
        row["draft_miss_rate"] = miss / (miss + drafts) if miss + drafts else None
        rows.append(row)
    return rows


def print_ratios(report: dict) -> None:
    print("\nratios (p50 for TTFT and TPOT; throughput = output tokens/s over the run):")
    print(f"{'drafter':<12} {'T':>3} {'load':<10} {'TTFT async/alone':>16} {'sync/alone':>10} "
          f"{'TPOT async/alone':>16} {'sync/alone':>10} {'async/sync':>10} {'tput async/alone':>16} "
          f"{'sync/alone':>10} {'async/sync':>10}")
    for r in report["ratios"]:
        vals = [r[k] for k in ("ttft_p50_async_over_alone", "ttft_p50_sync_over_alone", "tpot_p50_async_over_alone",
                               "tpot_p50_sync_over_alone", "tpot_p50_async_over_sync",
                               "throughput_async_over_alone", "throughput_sync_over_alone",
                               "throughput_async_over_sync")]
        widths = (16, 10, 16, 10, 10, 16, 10, 10)
        print(f"{r['drafter']:<12} {r['temperature']:>3g} {r['load']:<10} "
              + " ".join(f"{_num(v, '.2f'):>{w}}" for v, w in zip(vals, widths)))
    print("\nTandem vs HF transformers (T=0; HF runs requests one after another):")
    for r in report["hf_ratios"]:
        print(f"  {r['drafter']:<6} {r['load']:<5} {r['tandem_mode']:<6} {_num(r['tandem_tok_s'], '.1f'):>6} tok/s"
              f"  ÷ HF generate {_num(r['hf_tok_s'], '.1f')} = {_num(r['tandem_over_hf'], '.2f')}"
              f"  ÷ HF {r['drafter']} {_num(r['hf_spec_tok_s'], '.1f')} = {_num(r['tandem_over_hf_spec'], '.2f')}")
    print("\nacceptance rate / mean acceptance length per prompt kind (pooled over loads), draft-miss rate:")
    present = kinds_with_data(report["acceptance_by_kind"])
    for r in report["acceptance_by_kind"]:
        kinds = "  ".join(f"{k} {_num(r[k]['acceptance_rate'], '.0%')}/{_num(r[k]['mean_acceptance_length'], '.2f')}"
                          for k in present)
        print(f"  {r['drafter']:<6} {r['mode']:<5} T={r['temperature']:<3g} {kinds}  miss {_num(r['draft_miss_rate'], '.0%')}")


def environment() -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return ""

    import torch
    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "machine": platform.machine(), "git_commit": git("rev-parse", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain")), "loadavg_start": os.getloadavg()}


# ---- main -------------------------------------------------------------------------------------

def parse_config(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="every prompt, 128 tokens, c=1/4/16, both drafters")
    parser.add_argument("--num-prompts", type=int, help="prompts per cell (0: all 256); default 16")
    parser.add_argument("--max-tokens", type=int, help="default 48")
    parser.add_argument("--concurrency", type=int, nargs="+", help="closed-loop concurrencies; default 1 4")
    parser.add_argument("--temperatures", type=float, nargs="+", help="default 0 0.7")
    parser.add_argument("--rate", type=float, help="open-loop Poisson rate, requests/s; 0 skips it (default 2)")
    parser.add_argument("--open-loop-temperatures", type=float, nargs="+", help="default 0")
    parser.add_argument("--drafters", nargs="+", choices=DRAFTERS, help="default model (the distilled drafter)")
    parser.add_argument("--num-speculative-tokens", type=int, help="k, for Tandem and HF (default 4)")
    parser.add_argument("--rounds", type=int, help="chunks the modes alternate over (default 2)")
    parser.add_argument("--no-hf", dest="hf", action="store_false", default=None, help="skip mode 4")
    parser.add_argument("--hf-threads", type=int, help="torch threads for HF (default 1, as the target)")
    parser.add_argument("--model", help=f"the target (default {DEFAULT_MODEL})")
    parser.add_argument("--draft-model", help=f"the model drafter's model (default {DEFAULT_DRAFT_MODEL}, distilled)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--out", help="folder for latest.json and the PNGs (default bench/results)")
    args = vars(parser.parse_args(argv))
    full = args.pop("full")
    explicit = {k: v for k, v in args.items() if v is not None}
    try:  # --full sets its defaults; explicit flags override them
        return BenchConfig(full=full, **{**(FULL_DEFAULTS if full else {}), **explicit})
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(argv)
    started = time.time()
    prompts = load_prompts(config.num_prompts or None)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    env = environment()
    print(f"{len(prompts)} prompts, max_tokens {config.max_tokens}, concurrency {config.concurrency}, "
          f"T {config.temperatures}, rate {config.rate}/s, drafters {config.drafters}, k "
          f"{config.num_speculative_tokens}, {config.rounds} rounds; logs in {logs}", flush=True)
    hf = None
    if config.hf:
        from bench.hf_baseline import HFBaseline
        hf = HFBaseline(config.model, config.draft_model, config.hf_threads)
    print(HEADER, flush=True)
    cells = [c.to_json() for d in config.drafters for c in run_drafter(config, d, prompts, hf, logs)]
    env["loadavg_end"] = os.getloadavg()
    report = {
        "command": " ".join(["python -m bench.serve", *map(shlex.quote, sys.argv[1:] if argv is None else argv)]),
        "config": asdict(config), "environment": env, "wall_s": time.time() - started,
        "ratios": compute_ratios(cells), "hf_ratios": compute_hf_ratios(cells, config.concurrency),
        "acceptance_by_kind": acceptance_by_kind(cells), "cells": cells,
    }
    print_ratios(report)
    (out / "latest.json").write_text(json.dumps(report, indent=1))
    (out / "latest.md").write_text(results_markdown(report))  # the README's results table
    from bench.plots import plot_latency
    for path in plot_latency(report, out):
        print(f"wrote {path}")
    print(f"wrote {out / 'latest.json'} ({report['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
