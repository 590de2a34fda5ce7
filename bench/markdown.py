"""The results table of bench/README.md, made from a report (latest.json) so that it can be pasted."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.prompt_set import kinds_with_data


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _ms(x) -> str:
    return "–" if x is None else f"{x * 1000:.0f}"


def results_markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"Command: `{report['command']}` ({report['wall_s'] / 60:.0f} min; {env['cpus']} CPUs, "
             f"load average {env['loadavg_start'][0]:.1f} at start, {env['loadavg_end'][0]:.1f} at end; "
             f"commit {env['git_commit'][:10]}{' + local changes' if env['git_dirty'] else ''}).", "",
             "| drafter | mode | T | load | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 ms | e2e p50 s | tok/s "
             "| accept | MAL | miss |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in report["cells"]:
        s, server = c["summary"], c["server"] or {}
        t, p = s["ttft_s"], s["tpot_s"]
        a = s["acceptance"]
        lines.append(
            f"| {c['drafter']} | {c['mode']} | {c['temperature']:g} | {c['label']} | {_ms(t['p50'])} / {_ms(t['p90'])} / "
            f"{_ms(t['p99'])} | {_ms(p['p50'])} / {_ms(p['p90'])} | {_f(s['e2e_s']['p50'], '.2f')} | "
            f"{_f(s['throughput_tok_s'], '.1f')} | {_f(a['acceptance_rate'], '.0%')} | "
            f"{_f(a['mean_acceptance_length'], '.2f')} | {_f(server.get('draft_miss_rate'), '.0%')} |")
    lines += ["", "Ratios (same run; p50 for TTFT and TPOT):", "",
              "| drafter | T | load | TTFT async/alone | TTFT sync/alone | TPOT async/alone | TPOT sync/alone "
              "| TPOT async/sync | tok/s async/alone | tok/s sync/alone | tok/s async/sync |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["ratios"]:
        keys = ("ttft_p50_async_over_alone", "ttft_p50_sync_over_alone", "tpot_p50_async_over_alone",
                "tpot_p50_sync_over_alone", "tpot_p50_async_over_sync", "throughput_async_over_alone",
                "throughput_sync_over_alone", "throughput_async_over_sync")
        lines.append(f"| {r['drafter']} | {r['temperature']:g} | {r['load']} | "
                     + " | ".join(_f(r[k], ".2f") for k in keys) + " |")
    lines += ["", "Tandem against HF transformers, T=0 (HF serves one request after another):", "",
              "| drafter | load | Tandem mode | Tandem tok/s | HF generate tok/s | ratio | HF with drafter tok/s | ratio |",
              "|---|---|---|---|---|---|---|---|"]
    for r in report["hf_ratios"]:
        lines.append(f"| {r['drafter']} | {r['load']} | {r['tandem_mode']} | {_f(r['tandem_tok_s'], '.1f')} | "
                     f"{_f(r['hf_tok_s'], '.1f')} | {_f(r['tandem_over_hf'], '.2f')} | "
                     f"{_f(r['hf_spec_tok_s'], '.1f')} | {_f(r['tandem_over_hf_spec'], '.2f')} |")
    present = kinds_with_data(report["acceptance_by_kind"])
    lines += ["", "Acceptance rate / mean acceptance length per prompt kind (pooled over loads), draft-miss rate:", "",
              "| drafter | mode | T | " + " | ".join(present) + " | draft-miss rate |",
              "|---|---|---|" + "---|" * (len(present) + 1)]
    for r in report["acceptance_by_kind"]:
        kinds = " | ".join(f"{_f(r[k]['acceptance_rate'], '.0%')} / {_f(r[k]['mean_acceptance_length'], '.2f')}"
                           for k in present)
        lines.append(f"| {r['drafter']} | {r['mode']} | {r['temperature']:g} | {kinds} | "
                     f"{_f(r['draft_miss_rate'], '.0%')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "results" / "latest.json"
    print(results_markdown(json.loads(path.read_text())))
