"""The pair against the target alone across a network we set: loopback, then round trips of 0 to 40 ms.

    python -m bench.network [--rtts loopback,0,1,4,10,40]
                            [--drafters model,suffix+model,suffix/max-predraft-depth=1,suffix/@no-local-drafts]
                            [--kinds chat,rewrite] [--num-prompts 16] [--concurrency 1,8]
                            [--max-tokens 128] [--jitter-ms 0] [--eagle-head HEAD] [--pin]
                            [--out bench/results/network]

One phase per link, kind and concurrency: the draft service of each drafter, a delay proxy (bench/delay_proxy.py) in
front of it at that round trip (none for `loopback`), and a target whose --drafter is the proxy;
and the target alone (no drafter), all started afresh for the phase. A drafter's name may carry
settings after a '/' each: the draft service's flags, or with '@' first its target's. Every configuration is up at once, each
with one thread, and each group of requests (one prompt, or twice --concurrency prompts with
--concurrency of them in flight, as `vllm bench serve --max-concurrency` keeps them) goes to
every configuration in turn, the order rotating from group to group, so that the machine's drift
falls on all alike. Greedy, so a pair's outputs must equal the target alone's. With --pin, the targets run
on CPU 0 and the drafters, proxies and this driver on the other CPUs, as if the drafter had a
machine of its own (the memory bus stays shared).

Per phase, kind, concurrency and configuration it reports: tokens/s and its ratio to the target
alone of the same phase; the paired ratio, each group against alone's run of it beside it (the
geometric mean, with the range twice its standard error gives: what the machine's drift over the
run leaves of a cell); the mean of each stream's decode rate (tokens after its first, per second
after it: what speculation speeds up, free of the prefills' spread) against alone's; MAL (tokens
per verify step with drafts), TTFT p50 and its ratio, the mean draft round trip the target measured, time waited for drafts per decode step, the shares of
steps that missed drafts, verified the target's own lookup instead, or salvaged stale ones, dropped stale proposals, the tokens the speed
guard counted as gained less those lost against the target alone, how many outputs equal
the target alone's, and the CPU seconds of each process over the phase; the JSON also has the
target's steps by kind (prefill, decode, verify: how many, and their mean time). Writes a markdown table,
a JSON file and a plot of tokens/s / alone against round trip.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.delay_proxy import ProxyProcess
from bench.load import build_request, in_flight
from bench.prompt_set import KINDS, Prompt, load_prompts
from bench.scrape import counters, delta
from bench.serve import DRAFTERS, EAGLE3, eagle3_drafter_flags
from bench.stats import paired_ratio
from tandem.client import generate
from tandem.launch import ServiceProcess, cpu_seconds
from tandem.registry import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL
from tandem.v1 import generation_pb2_grpc

ALONE = "alone"
LOOPBACK = "loopback"
WARM_PROMPTS = 2  # per kind, before a phase's measured requests: not measured
# Several at once, a group keeps --concurrency requests in flight over this many times as many prompts,
# so that a request that ends early makes room for the next, as in serving; a group of exactly
# --concurrency would wait for its slowest request, and a request sped up would free nothing.
IN_FLIGHT_TURN = 2

@dataclass
class Service:
    """One configuration: a target, and for a pair its draft service and proxy."""

    name: str
    target: ServiceProcess
    draft: ServiceProcess | None = None
    proxy: ProxyProcess | None = None

    def processes(self) -> dict[str, object]:
        found = {"target": self.target.process, "draft": self.draft and self.draft.process,
                 "proxy": self.proxy and self.proxy.process}
        return {role: p for role, p in found.items() if p is not None}

    def stop(self) -> None:
        self.target.terminate(10)
        if self.proxy is not None:
            self.proxy.terminate()
        if self.draft is not None:
            self.draft.terminate(10)


@dataclass
class NetworkCell:
    """What one configuration did on one (phase, kind, concurrency)."""

    phase: str
    kind: str
    concurrency: int
    config: str
    tokens: int = 0
    seconds: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    decode_rates: list[float] = field(default_factory=list)  # each request's tokens/s after its first token
    group_rates: list[float] = field(default_factory=list)  # each group's tokens/s, in the order driven
    outputs: dict[str, list[int]] = field(default_factory=dict)  # by prompt id
    counters: dict[str, float] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


async def run_group(address: str, prompts: list[Prompt], max_tokens: int, concurrency: int) -> tuple[float, list]:
    """Sends the prompts on one channel, `concurrency` in flight; the wall time of the group, and each result."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        requests = [build_request(p, i, 0.0, max_tokens, None, 0) for i, p in enumerate(prompts)]
        began = time.perf_counter()
        results = await in_flight([functools.partial(generate, stub, r, timeout=600) for r in requests], concurrency)
        return time.perf_counter() - began, results


def groups(prompts: list[Prompt], size: int) -> list[list[Prompt]]:
    """Windows of `size` prompts (wrapping around), covering each once."""
    count = max(1, round(len(prompts) / size))
    return [[prompts[(g * size + i) % len(prompts)] for i in range(size)] for g in range(count)]


def group_size(concurrency: int, prompts: int) -> int:
    """Prompts per group: one at a time, or IN_FLIGHT_TURN times the requests kept in flight, but no
    more than there are prompts: a suffix drafter would draft a prompt's second run from its first."""
    return 1 if concurrency == 1 else min(IN_FLIGHT_TURN * concurrency, prompts)


def _flags(settings: list[str]) -> list[str]:
    """flag=value settings as command-line words; a switch has no value."""
    return [part for setting in settings for part in ("--" + setting).split("=", 1)]


def drafter_flags(drafter: str, args: argparse.Namespace) -> list[str]:
    """The draft service's flags for one drafter: its kind, then any flag=value after a '/' each
    (suffix/max-predraft-depth=1), so that settings of one drafter run side by side. Settings that
    begin with '@' are the pair's target's (target_flags)."""
    kind, *settings = drafter.split("/")
    extra = _flags([s for s in settings if not s.startswith("@")])
    if kind == EAGLE3:
        return [*eagle3_drafter_flags(args.eagle_head, args.model), *extra]
    draft_model = args.draft_model if "model" in kind else args.model  # lookup drafters load its tokenizer
    return ["--model", draft_model, "--drafter", kind, *extra]


def target_flags(drafter: str) -> list[str]:
    """The pair's target's own settings in a drafter's name, '@' first (suffix/@no-local-drafts/@draft-wait-ms=0)."""
    return _flags([s[1:] for s in drafter.split("/")[1:] if s.startswith("@")])


def start_pair(drafter: str, link: str, args: argparse.Namespace, logs: Path) -> Service:
    tag = f"{drafter}-{link}".translate(str.maketrans("+/=", "___"))
    draft = ServiceProcess("draft_service", [*drafter_flags(drafter, args), "--threads", "1"],
                           log_path=logs / f"draft-{tag}.log").start()
    proxy = None
    address = draft.address
    if link != LOOPBACK:
        proxy = ProxyProcess(draft.address, float(link) / 2, args.jitter_ms, log_path=logs / f"proxy-{tag}.log").start()
        address = proxy.address
    target = ServiceProcess("target_service", ["--model", args.model, "--threads", "1", "--drafter", address,
                                               *target_flags(drafter)],
                            log_path=logs / f"target-{tag}.log").start()
    return Service(drafter, target, draft, proxy)


def start_alone(link: str, args: argparse.Namespace, logs: Path) -> Service:
    return Service(ALONE, ServiceProcess("target_service", ["--model", args.model, "--threads", "1"],
                                         log_path=logs / f"target-alone-{link}.log").start())


def run_phase(link: str, kind: str, concurrency: int, args: argparse.Namespace, prompts: list[Prompt],
              warm: list[Prompt], logs: Path) -> tuple[list[NetworkCell], dict[str, dict[str, float]]]:
    """Every configuration started afresh, then driven in turn. Afresh for each kind and concurrency
    too: a suffix drafter keeps the outputs of earlier requests, and would draft a prompt's second
    run from its first."""
    services = [start_alone(link, args, logs), *(start_pair(drafter, link, args, logs) for drafter in args.drafters)]
    pairs = services[1:]
    try:
        for service in services:
            service.target.wait_healthy(300)
        for pair in pairs:
            pair.draft.wait_healthy(300)
            pair.target.wait_metric("tandem_drafter_connected", 1.0)
        if args.pin:
            pin_services(services)
        for service in services:
            asyncio.run(run_group(service.target.address, warm, 32, len(warm)))
        cpu_before = {(s.name, role): cpu_seconds(p.pid) for s in services for role, p in s.processes().items()}
        cells = drive(link, kind, concurrency, services, groups(prompts, group_size(concurrency, len(prompts))), args.max_tokens)
        cpu = {s.name: {role: cpu_seconds(p.pid) - cpu_before[s.name, role] for role, p in s.processes().items()}
               for s in services}
        return cells, cpu
    finally:
        for service in services:
            service.stop()


TARGET_CPUS = {0}  # --pin: the targets' CPU; the drafters, proxies and this driver get the others


def other_cpus() -> set[int]:
    return os.sched_getaffinity(0) - TARGET_CPUS


def pin_services(services: list[Service]) -> None:
    """Every target on TARGET_CPUS, every drafter and proxy on the other CPUs: each thread of each process."""
    for service in services:
        for role, process in service.processes().items():
            cpus = TARGET_CPUS if role == "target" else other_cpus()
            for task in Path(f"/proc/{process.pid}/task").iterdir():
                os.sched_setaffinity(int(task.name), cpus)


def drive(link: str, kind: str, concurrency: int, services: list[Service], batches: list[list[Prompt]],
          max_tokens: int) -> list[NetworkCell]:
    """Each group to every configuration in turn, the order rotating from group to group."""
    cells = {s.name: NetworkCell(link, kind, concurrency, s.name) for s in services}
    for g, batch in enumerate(batches):
        order = services[g % len(services):] + services[:g % len(services)]
        for service in order:
            cell = cells[service.name]
            before = counters(service.target.metrics_url)
            seconds, results = asyncio.run(run_group(service.target.address, batch, max_tokens, concurrency))
            after = counters(service.target.metrics_url)
            tokens = sum(len(r.token_ids) for r in results)
            cell.seconds += seconds
            cell.tokens += tokens
            cell.group_rates.append(tokens / seconds)
            cell.ttfts += [r.ttft for r in results]
            cell.decode_rates += [r.decode_tokens_per_second for r in results if len(r.token_ids) > 1]
            cell.outputs.update({p.id: r.token_ids for p, r in zip(batch, results)})
            for name, change in delta(before, after).items():
                cell.counters[name] = cell.counters.get(name, 0.0) + change
        print(f"  {link} {kind} c={concurrency} group {g + 1}/{len(batches)}: "
              + ", ".join(f"{c.config} {c.tok_s:.1f}" for c in cells.values()), flush=True)
    return list(cells.values())


def row(cell: NetworkCell, alone: NetworkCell, cpu: dict[str, float]) -> dict:
    c = cell.counters
    steps = c["step_decode_count"] + c["step_verify_count"]
    speculating_steps = c["drafts"] + c["draft_miss"]
    ttft = statistics.median(cell.ttfts)
    return {
        "phase": cell.phase, "kind": cell.kind, "concurrency": cell.concurrency, "config": cell.config,
        "tok_s": cell.tok_s, "vs_alone": cell.tok_s / alone.tok_s,
        # Group by group against alone's run of the same prompts just before or after: free of the drift
        # over the run; (geometric mean, twice its standard error as a factor).
        "paired_vs_alone": paired_ratio(cell.group_rates, alone.group_rates),
        # What speculation speeds up, without the prefills' run-to-run spread: a stream's rate after its first token.
        "decode_vs_alone": (statistics.mean(cell.decode_rates) / statistics.mean(alone.decode_rates)
                            if cell.decode_rates and alone.decode_rates else None),
        "mal": 1 + c["accepted_tokens"] / c["drafts"] if c["drafts"] else None,
        "ttft_p50_ms": ttft * 1000, "ttft_vs_alone": ttft / statistics.median(alone.ttfts),
        "draft_rtt_ms": 1000 * c["draft_rtt_sum"] / c["draft_rtt_count"] if c["draft_rtt_count"] else None,
        "wait_ms_per_step": 1000 * c["draft_wait_sum"] / steps if steps else None,
        "missed": c["draft_miss"] / speculating_steps if speculating_steps else None,
        "own_lookup": c["draft_local"] / speculating_steps if speculating_steps else None,
        "salvaged": c["stale_salvaged"] / speculating_steps if speculating_steps else None,
        "dropped": int(c["stale_dropped"]),
        "guard_net_tokens": c["guard_gained"] - c["guard_lost"],
        "identical": sum(cell.outputs[p] == alone.outputs[p] for p in alone.outputs),
        "prompts": len(alone.outputs),
        "cpu_s": cpu,
        # Where the target's time went: its steps by kind, how many and how long each took (served).
        "steps": {kind: {"count": int(c[f"step_{kind}_count"]),
                         "mean_ms": 1000 * c[f"step_{kind}_sum"] / c[f"step_{kind}_count"]
                         if c[f"step_{kind}_count"] else None}
                  for kind in ("prefill", "decode", "verify")},
    }


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _paired(paired: tuple[float, float] | None) -> str:
    """1.05 (0.99-1.11): the paired ratio and the range its spread gives."""
    if paired is None:
        return "-"
    mean, spread = paired
    return f"{mean:.2f} ({mean / spread:.2f}-{mean * spread:.2f})"


def markdown(rows: list[dict]) -> str:
    lines = ["| link | kind | c | config | tok/s | ÷ alone | paired ÷ alone (±2 SE range) | stream decode ÷ alone | MAL "
             "| TTFT p50 ms (÷ alone) | draft RTT ms | wait ms/step | missed | own lookup | salvaged | dropped "
             "| guard: net tokens | identical | CPU s target / draft / proxy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cpu = " / ".join(_fmt(r["cpu_s"].get(role), ".1f") for role in ("target", "draft", "proxy"))
        lines.append(
            f"| {r['phase']} | {r['kind']} | {r['concurrency']} | {r['config']} | {r['tok_s']:.1f} | "
            f"{r['vs_alone']:.2f} | {_paired(r['paired_vs_alone'])} | {_fmt(r['decode_vs_alone'], '.2f')} | "
            f"{_fmt(r['mal'], '.2f')} | "
            f"{r['ttft_p50_ms']:.0f} ({r['ttft_vs_alone']:.2f}) | "
            f"{_fmt(r['draft_rtt_ms'], '.1f')} | {_fmt(r['wait_ms_per_step'], '.2f')} | {_fmt(r['missed'], '.0%')} | "
            f"{_fmt(r['own_lookup'], '.0%')} | {_fmt(r['salvaged'], '.0%')} | {r['dropped']} | "
            f"{r['guard_net_tokens']:+.0f} | "
            f"{r['identical']}/{r['prompts']} | {cpu} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """tokens/s / alone against round trip, one line per (drafter, kind, concurrency); loopback at 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    lines = sorted({(r["config"], r["kind"], r["concurrency"]) for r in rows if r["config"] != ALONE})
    for config, kind, concurrency in lines:
        points = sorted((0.0 if r["phase"] == LOOPBACK else float(r["phase"]), r["vs_alone"]) for r in rows
                        if (r["config"], r["kind"], r["concurrency"]) == (config, kind, concurrency)
                        and r["phase"] != LOOPBACK)
        loop = [r["vs_alone"] for r in rows if (r["config"], r["kind"], r["concurrency"], r["phase"])
                == (config, kind, concurrency, LOOPBACK)]
        line, = ax.plot([x for x, _ in points], [y for _, y in points], marker="o",
                        label=f"{config}, {kind}, c={concurrency}")
        if loop:
            ax.plot([0], loop, marker="*", markersize=12, color=line.get_color(), linestyle="none")
    ax.axhline(1.0, color="gray", linewidth=1)
    ax.axhline(0.98, color="gray", linewidth=1, linestyle=":")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("round trip between target and drafter, ms (star: loopback, no proxy)")
    ax.set_ylabel("tokens/s ÷ target alone")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--rtts", default="loopback,0,1,4,10,40", help="loopback, or round trips in ms")
    parser.add_argument("--drafters", default="model,suffix+model")
    parser.add_argument("--kinds", default="chat,rewrite")
    parser.add_argument("--num-prompts", type=int, default=16, help="per kind")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="each way, uniform in [0, this]")
    parser.add_argument("--eagle-head", help="an EAGLE-3 head folder for the drafter eagle3 (distill --kind eagle3)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "network")
    parser.add_argument("--pin", action="store_true",
                        help="targets on CPU 0; drafters, proxies and the driver on the others, as if the "
                             "drafter had a machine of its own (the memory bus stays shared)")
    args = parser.parse_args(argv)
    args.rtts = args.rtts.split(",")
    args.drafters = args.drafters.split(",")
    args.kinds = args.kinds.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    kinds_of_drafters = [drafter.split("/")[0] for drafter in args.drafters]
    for name, given, known in (("--drafters", kinds_of_drafters, (*DRAFTERS, EAGLE3)), ("--kinds", args.kinds, KINDS)):
        if unknown := [g for g in given if g not in known]:
            parser.error(f"{name}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if EAGLE3 in kinds_of_drafters and not args.eagle_head:
        parser.error("the drafter eagle3 needs --eagle-head")
    if args.pin and not (TARGET_CPUS < os.sched_getaffinity(0) and other_cpus()):
        parser.error(f"--pin needs CPUs {sorted(TARGET_CPUS)} and at least one other")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.pin:
        os.sched_setaffinity(0, other_cpus())
    everything = load_prompts()
    by_kind = {kind: [p for p in everything if p.kind == kind] for kind in args.kinds}
    prompts = {kind: ps[:args.num_prompts] for kind, ps in by_kind.items()}
    warm = {kind: ps[args.num_prompts:args.num_prompts + WARM_PROMPTS] for kind, ps in by_kind.items()}
    logs = Path(tempfile.mkdtemp(prefix="tandem-network-"))
    print(f"logs in {logs}", flush=True)
    rows = []
    for link in args.rtts:
        for kind in args.kinds:
            for concurrency in args.concurrency:
                cells, cpu = run_phase(link, kind, concurrency, args, prompts[kind], warm[kind], logs)
                reference = next(c for c in cells if c.config == ALONE)
                phase = [row(cell, reference, cpu[cell.config]) for cell in cells]
                rows += phase
                print(markdown(phase), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table = markdown(rows)
    args.out.with_suffix(".md").write_text(table + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                          "rows": rows}, indent=1))
    plot(rows, args.out.with_suffix(".png"))
    print(table)
    return rows


if __name__ == "__main__":
    main()
