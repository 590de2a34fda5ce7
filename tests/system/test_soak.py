"""Soak: concurrent greedy load with client cancels, deadlines, a drafter killed and restarted every
~20 s, and a SIGTERM drain at the end. Nothing may be lost: every request that finished returns
the target-alone tokens, no sequence state is left on either service, RSS stays flat, and the
target's counters agree with what the clients saw.

Both are `-m slow`, kept out of `make test` for its time budget: `pytest -m slow tests/system/test_soak.py`
runs the short version (40 s of load) and the long one, `TANDEM_SOAK_MINUTES=10` long.
"""
from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from tests.support.service_fixtures import PROMPTS, greedy_request, metric, run_requests, scrape
from tandem.client import FINISH_NAMES, generate, open_channel
from tandem.launch import ServiceProcess
from tandem.v1 import generation_pb2_grpc

MAX_TOKENS = (6, 12)
CONCURRENCY = 6
DRAFTER_RESTART_SECONDS = 20.0
CANCEL_FRACTION = 0.15
DEADLINE_FRACTION = 0.15
RSS_GROWTH_LIMIT = 0.10


def rss_bytes(pid: int) -> int:
    """VmRSS from /proc (psutil is not a dependency)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class SoakTally:
    outcomes: Counter = field(default_factory=Counter)  # ok / cancelled / deadline / exhausted
    finish: Counter = field(default_factory=Counter)  # finish reasons of the ok ones
    tokens_ok: int = 0  # tokens received by requests that finished
    tokens_partial: int = 0  # tokens received by cancelled or timed-out requests
    max_tokens_partial: int = 0  # what those could have made the server generate
    mismatches: list = field(default_factory=list)
    drafter_restarts: int = 0


class Soak:
    def __init__(self, logs: Path, seconds: float, seed: int = 7):
        self.logs = logs
        self.seconds = seconds
        self.rng = random.Random(seed)
        self.tally = SoakTally()
        self.draft = ServiceProcess("draft_service", ["--drafter", "ngram", "--threads", "1"],
                                    log_path=logs / "draft.log")
        self.target = ServiceProcess("target_service", ["--threads", "1", "--max-model-len", "512",
                                                        "--max-num-seqs", "4", "--draft-wait-ms", "2",
                                                        "--reconnect-max-seconds", "1",
                                                        "--grace-seconds", "60", "--drafter", self.draft.address],
                                     log_path=logs / "target.log")
        self.cases = [(p, n) for p in PROMPTS for n in MAX_TOKENS]
        self.reference: dict[tuple[str, int], list[int]] = {}

    def start(self) -> None:
        self.draft.start()
        self.target.start()
        self.draft.wait_healthy(300)
        self.target.wait_healthy(300)

    def stop(self) -> None:
        self.target.kill()
        self.draft.kill()

    def compute_reference(self) -> None:
        results = run_requests(self.target.address,
                               [greedy_request(p, n, speculate=False) for p, n in self.cases], concurrency=4)
        self.reference = {case: r.token_ids for case, r in zip(self.cases, results)}

    def restart_drafter(self) -> None:
        self.draft.kill()
        self.draft = self.draft.restarted().wait_healthy(300)
        self.tally.drafter_restarts += 1

    async def one(self, stub) -> None:
        prompt, max_tokens = case = self.rng.choice(self.cases)
        request = greedy_request(prompt, max_tokens, speculate=self.rng.random() < 0.8)
        roll = self.rng.random()
        timeout = self.rng.uniform(0.05, 1.5) if roll < DEADLINE_FRACTION else 120.0
        cancel_after = self.rng.uniform(0.0, 1.5) if roll > 1 - CANCEL_FRACTION else None
        call = stub.Generate(request, timeout=timeout)
        received: list[int] = []
        finish = ""
        reported = -1  # usage.completion_tokens of the last response

        async def consume():
            nonlocal finish, reported
            async for response in call:
                received.extend(response.token_ids)
                if response.finish_reason:
                    finish = FINISH_NAMES[response.finish_reason]
                    reported = response.usage.completion_tokens

        task = asyncio.ensure_future(consume())
        try:
            if cancel_after is not None:
                done, _ = await asyncio.wait([task], timeout=cancel_after)
                if not done:
                    call.cancel()
            await task
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as err:
            code = getattr(err, "code", lambda: grpc.StatusCode.CANCELLED)()
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.tally.outcomes["exhausted"] += 1
                return
            assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED), f"{code}: {err}"
            self.tally.outcomes["cancelled" if code == grpc.StatusCode.CANCELLED else "deadline"] += 1
            self.tally.tokens_partial += len(received)
            self.tally.max_tokens_partial += max_tokens
            return
        if call.cancelled() or not finish:  # cancelled just as it finished: the client may miss the end
            self.tally.outcomes["cancelled"] += 1
            self.tally.tokens_partial += len(received)
            self.tally.max_tokens_partial += max_tokens
            return
        self.tally.outcomes["ok"] += 1
        self.tally.finish[finish] += 1
        self.tally.tokens_ok += len(received)
        if received != self.reference[case] or reported != len(received):
            self.tally.mismatches.append((case, received, self.reference[case], reported))

    async def load(self, seconds: float, restart_drafter: bool) -> None:
        end = time.monotonic() + seconds
        next_restart = time.monotonic() + DRAFTER_RESTART_SECONDS
        async with open_channel(self.target.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)

            async def worker():
                while time.monotonic() < end:
                    await self.one(stub)

            workers = [asyncio.ensure_future(worker()) for _ in range(CONCURRENCY)]
            while time.monotonic() < end and not all(w.done() for w in workers):
                await asyncio.sleep(0.2)
                if restart_drafter and time.monotonic() >= next_restart and time.monotonic() < end - 5:
                    await asyncio.to_thread(self.restart_drafter)
                    next_restart = time.monotonic() + DRAFTER_RESTART_SECONDS
            await asyncio.gather(*workers)


def wait_idle(target: ServiceProcess, draft: ServiceProcess, timeout: float = 30.0) -> dict[str, float]:
    """Waits until neither service holds a sequence; returns the target's last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(target.metrics_url)
        running = metric(samples, "tandem_num_requests_running") + metric(samples, "tandem_num_requests_waiting")
        drafting = metric(scrape(draft.metrics_url), "tandem_draft_sequences")
        if running == 0 and drafting == 0:
            return samples
        assert time.monotonic() < deadline, f"state left: {running} on the target, {drafting} on the drafter"
        time.sleep(0.25)


def _delta(after: dict, before: dict, name: str, **labels) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def run_soak(logs: Path, seconds: float) -> SoakTally:
    soak = Soak(logs, seconds)
    try:
        soak.start()
        soak.compute_reference()
        warm_up = min(15.0, seconds / 4)
        asyncio.run(soak.load(warm_up, restart_drafter=False))
        soak.tally = SoakTally()  # the warm-up's outcomes are not counted against the metrics window
        wait_idle(soak.target, soak.draft)
        rss_start = rss_bytes(soak.target.process.pid)
        before = scrape(soak.target.metrics_url)

        asyncio.run(soak.load(seconds - warm_up, restart_drafter=True))

        after = wait_idle(soak.target, soak.draft)
        rss_end = rss_bytes(soak.target.process.pid)
        tally = soak.tally
        print(f"\nsoak: {sum(tally.outcomes.values())} requests {dict(tally.outcomes)}, finish {dict(tally.finish)}, "
              f"drafter restarts {tally.drafter_restarts}, tokens lost {len(tally.mismatches)}, "
              f"target RSS {rss_start / 2**20:.0f} -> {rss_end / 2**20:.0f} MiB "
              f"({(rss_end - rss_start) / rss_start:+.1%})")

        assert not tally.mismatches, (f"{len(tally.mismatches)} outputs differ from the target alone: "
                                      f"{tally.mismatches[:3]}")
        assert tally.outcomes["ok"] > 0 and tally.drafter_restarts >= 1
        assert _delta(after, before, "tandem_spec_decode_num_draft_tokens_total") > 0, "speculation never ran"
        assert rss_end <= rss_start * (1 + RSS_GROWTH_LIMIT), (rss_start, rss_end)
        # Counters against the clients. Exact where the client saw the end; bounded where it left early,
        # since a cancelled request may have been generating when the cancel arrived, or never arrived.
        finished = {reason: _delta(after, before, "tandem_request_success_total", finish_reason=reason)
                    for reason in ("stop", "length", "abort")}
        left = tally.outcomes["cancelled"] + tally.outcomes["deadline"]
        completed = tally.outcomes["ok"]
        assert completed <= finished["stop"] + finished["length"] <= completed + left, (finished, tally)
        assert finished["length"] >= tally.finish["length"] and finished["stop"] >= tally.finish["stop"]
        assert finished["abort"] <= left
        generated = _delta(after, before, "tandem_generation_tokens_total")
        assert tally.tokens_ok + tally.tokens_partial <= generated <= tally.tokens_ok + tally.max_tokens_partial

        drain(soak)
        return tally
    finally:
        soak.stop()


def drain(soak: Soak) -> None:
    """SIGTERM with requests running: they finish with the right tokens, later ones get UNAVAILABLE."""
    cases = soak.cases[:4]

    async def main():
        async with open_channel(soak.target.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            running = [asyncio.ensure_future(generate(stub, greedy_request(p, n), timeout=120)) for p, n in cases]
            await asyncio.sleep(0.3)
            soak.target.process.send_signal(15)
            await asyncio.sleep(0.5)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await generate(stub, greedy_request(*cases[0]), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            return await asyncio.gather(*running)

    results = asyncio.run(main())
    assert [r.token_ids for r in results] == [soak.reference[c] for c in cases]
    assert soak.target.process.wait(60) == 0
    drafting = metric(scrape(soak.draft.metrics_url), "tandem_draft_sequences")
    deadline = time.monotonic() + 10
    while drafting and time.monotonic() < deadline:
        time.sleep(0.2)
        drafting = metric(scrape(soak.draft.metrics_url), "tandem_draft_sequences")
    assert drafting == 0


@pytest.mark.slow
def test_soak_short(tmp_path):
    run_soak(tmp_path, seconds=40.0)  # a 10 s warm-up, then 30 s with one drafter restart at 20 s


@pytest.mark.slow
def test_soak_long(tmp_path):
    run_soak(tmp_path, seconds=60.0 * float(os.environ.get("TANDEM_SOAK_MINUTES", "10")))
