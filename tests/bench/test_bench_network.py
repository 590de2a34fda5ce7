"""bench.network's rows: the ratios a configuration is judged by, from what its requests did."""
from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import network
from bench.load import in_flight
from bench.stats import paired_ratio
from bench.scrape import COUNTERS
from tandem.launch import ServiceProcess


def _cell(config: str, seconds: float, ttfts: list[float], decode_rates: list[float], group_rates: list[float],
          **counters: float) -> network.NetworkCell:
    cell = network.NetworkCell(network.LOOPBACK, "rewrite", 8, config, tokens=200, seconds=seconds, ttfts=ttfts,
                               decode_rates=decode_rates, group_rates=group_rates, outputs={"a": [1, 2], "b": [3]})
    cell.counters = {name: 0.0 for name in COUNTERS} | counters
    return cell


def test_a_row_sets_the_streams_decode_rate_apart_from_the_groups_wall_time():
    alone = _cell(network.ALONE, 10.0, [1.0, 3.0], [20.0, 30.0], [25.0, 15.0])
    # Slower prefills made the group's wall time longer, while each stream decoded faster.
    pair = _cell("suffix", 12.5, [2.0, 4.0], [30.0, 30.0], [20.0, 12.0], drafts=10, accepted_tokens=12,
                 draft_miss=5, draft_local=3,
                 step_decode_count=20, step_decode_sum=0.1, step_verify_count=10, step_verify_sum=0.09)
    row = network.row(pair, alone, {"target": 1.0})
    assert row["vs_alone"] == pytest.approx(0.8)
    assert row["decode_vs_alone"] == pytest.approx(1.2)
    assert row["ttft_vs_alone"] == pytest.approx(1.5)
    assert row["mal"] == pytest.approx(2.2)
    assert row["paired_vs_alone"] == (pytest.approx(0.8), pytest.approx(1.0))  # each group at 0.8: no spread
    assert "| 0.80 | 0.80 (0.80-0.80) | 1.20 | 2.20 |" in network.markdown([row])
    # Of 15 steps that could speculate, 5 missed; 3 of the 10 that verified drafts had the target's own.
    assert (row["missed"], row["own_lookup"]) == (pytest.approx(1 / 3), pytest.approx(0.2))
    assert "| 33% | 20% |" in network.markdown([row])
    assert row["steps"]["decode"] == {"count": 20, "mean_ms": pytest.approx(5.0)}
    assert row["steps"]["verify"] == {"count": 10, "mean_ms": pytest.approx(9.0)}
    assert row["steps"]["prefill"] == {"count": 0, "mean_ms": None}


@pytest.mark.parametrize("flags, named", [(["--kinds", "chat,poetry"], "poetry"), (["--drafters", "suffix,medusa"], "medusa")])
def test_an_unknown_kind_or_drafter_is_refused_before_any_service_starts(flags, named, capsys):
    with pytest.raises(SystemExit) as refused:
        network.parse_args(flags)
    assert refused.value.code == 2
    assert f"unknown {named}" in capsys.readouterr().err


def test_a_drafter_may_carry_its_own_flags_so_that_two_settings_run_side_by_side():
    args = network.parse_args(["--drafters", "suffix,suffix/max-predraft-depth=1/max-fanout=2"])
    assert args.drafters == ["suffix", "suffix/max-predraft-depth=1/max-fanout=2"]
    assert network.drafter_flags(args.drafters[1], args)[-6:] == [
        "--drafter", "suffix", "--max-predraft-depth", "1", "--max-fanout", "2"]
    assert network.drafter_flags("suffix/no-prefix-caching", args)[-1] == "--no-prefix-caching"
    assert network.target_flags(args.drafters[1]) == []
    with pytest.raises(SystemExit):
        network.parse_args(["--drafters", "medusa/max-fanout=2"])


def test_settings_with_an_at_sign_go_to_the_pairs_target_and_not_to_its_drafter():
    args = network.parse_args(["--drafters", "suffix/@no-local-drafts/max-fanout=2/@draft-wait-ms=0"])
    drafter = args.drafters[0]
    assert network.target_flags(drafter) == ["--no-local-drafts", "--draft-wait-ms", "0"]
    assert network.drafter_flags(drafter, args)[-4:] == ["--drafter", "suffix", "--max-fanout", "2"]


def test_pin_puts_every_thread_of_a_target_on_its_cpu_and_of_a_drafter_on_the_others():
    script = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    processes = {role: subprocess.Popen([sys.executable, "-c", script]) for role in ("target", "draft")}
    try:
        time.sleep(0.5)  # both threads started
        service = network.Service("suffix", ServiceProcess("target_service", process=processes["target"]),
                                  ServiceProcess("draft_service", process=processes["draft"]))
        network.pin_services([service])
        for role, process in processes.items():
            tasks = list(Path(f"/proc/{process.pid}/task").iterdir())
            assert len(tasks) == 2
            expected = network.TARGET_CPUS if role == "target" else network.other_cpus()
            assert all(os.sched_getaffinity(int(task.name)) == expected for task in tasks), role
    finally:
        for process in processes.values():
            process.kill()
            process.wait()


def test_the_paired_ratio_is_the_geometric_mean_of_each_group_against_alone_beside_it():
    """The machine ran twice as fast in the second half: each group is compared with alone's beside it."""
    ratio, spread = paired_ratio([11.0, 12.0, 22.0, 24.0], [10.0, 10.0, 20.0, 20.0])
    assert ratio == pytest.approx(math.sqrt(1.1 * 1.2))
    # log ratios a, b, a, b: standard deviation (b - a) / sqrt(3), standard error half that; spread e^(2 SE)
    assert spread == pytest.approx(math.exp(2 * math.log(1.2 / 1.1) / math.sqrt(3) / 2))
    assert paired_ratio([1.0], [1.0]) is None  # one pair has no spread


def test_several_at_once_keep_that_many_in_flight_a_new_one_starting_as_one_ends():
    running, most, order, ended = 0, 0, [], []

    async def request(i: int, seconds: float) -> int:
        nonlocal running, most
        running += 1
        most = max(most, running)
        order.append(i)
        await asyncio.sleep(seconds)
        running -= 1
        ended.append(i)
        return i

    # The first request is long: the others pass it, two at a time beside it, never waiting for it.
    calls = [lambda i=i: request(i, 0.3 if i == 0 else 0.01) for i in range(6)]
    assert asyncio.run(in_flight(calls, 3)) == list(range(6))
    assert most == 3 and order == list(range(6))
    assert ended[-1] == 0  # every other one started and ended while it ran


def test_a_group_is_one_prompt_or_twice_the_requests_in_flight_covering_every_prompt():
    prompts = list(range(48))
    assert network.groups(prompts, network.group_size(1, 48)) == [[p] for p in prompts]
    windows = network.groups(prompts, network.group_size(8, 48))
    assert [len(w) for w in windows] == [16, 16, 16] and sorted(sum(windows, [])) == prompts
    # Fewer prompts than a group holds: each once, not a prompt twice in one group.
    assert network.groups(prompts[:6], network.group_size(8, 6)) == [prompts[:6]]
