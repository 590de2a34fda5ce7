"""A target and a draft service as real processes on loopback, connected, and the drafter's restart."""
from __future__ import annotations

import time

import pytest

from tests.support.service_fixtures import metric, scrape, service_process
from tandem.launch import ServiceProcess

# TWO_THREADS: pairs whose services never compete for the 2 cores take both, and run twice as fast.
# A synchronous pair takes turns (the target waits for its drafts, the drafter for the next update);
# a lookup drafter's work takes microseconds, so its target may have both cores.
TWO_THREADS = ["--threads", "2"]  # after start_pair's "--threads 1": the last flag given wins


def start_pair(tmp_path_factory, name: str, draft_args: list[str], target_args: list[str] = ()
               ) -> tuple[ServiceProcess, ServiceProcess]:
    """(drafter, target), healthy and connected; the caller kills both."""
    logs = tmp_path_factory.mktemp(name)
    draft = service_process("draft_service", ["--threads", "1", "--max-model-len", "512", *draft_args],
                            log_path=logs / "draft.log").start()
    target = service_process("target_service", ["--threads", "1", "--max-model-len", "512", "--drafter",
                                                draft.address, *target_args], log_path=logs / "target.log").start()
    try:
        draft.wait_healthy()
        target.wait_healthy()
        wait_connected(target)
    except BaseException:  # a fixture whose setup fails gets no teardown: leave no service behind
        target.kill()
        draft.kill()
        raise
    return draft, target


def wait_connected(target: ServiceProcess, connected: bool = True, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(scrape(target.metrics_url), "tandem_drafter_connected") == float(connected):
            return
        time.sleep(0.1)
    raise AssertionError(f"tandem_drafter_connected did not become {int(connected)}")


def waits_between(before: list, after: list) -> tuple[float, float, float]:
    """(decode and verify steps, steps that waited for drafts, seconds waited) between two scrapes
    of a target's /metrics."""

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    steps = sum(delta("tandem_step_duration_seconds_count", kind=kind) for kind in ("decode", "verify"))
    return steps, delta("tandem_draft_wait_seconds_count"), delta("tandem_draft_wait_seconds_sum")


def restart_drafter(draft: ServiceProcess, target: ServiceProcess) -> ServiceProcess:
    """Kills the drafter, waits for the target to see it gone, starts it again and waits for the
    target to reconnect: what the target's running sequences see of a drafter's crash and restart."""
    draft.kill()
    wait_connected(target, connected=False)
    draft = draft.restarted().wait_healthy()
    wait_connected(target, connected=True)
    return draft


def pair_fixture(drafter: str, target_args: list[str] = (), draft_args: list[str] = (), scope: str = "module"):
    """A pair with the given drafter, killed when the scope ends."""

    @pytest.fixture(scope=scope)
    def pair(tmp_path_factory):
        draft, target = start_pair(tmp_path_factory, drafter, ["--drafter", drafter, *draft_args], target_args)
        yield draft, target
        target.kill()
        draft.kill()

    return pair
