"""The pair through a delayed, jittery link that partitions and loses its drafter: a run of a few
minutes, `-m slow`. Clients get the target alone's tokens throughout, steps do not wait on a link
that forwards nothing, and speculation comes back after each fault."""
from __future__ import annotations

import threading
import time

import pytest

from bench.delay_proxy import ProxyProcess
from tests.support.pairs import wait_connected, waits_between
from tests.support.service_fixtures import greedy_request, metric, run_requests, scrape, service_process
from tandem.launch import ServiceProcess

pytestmark = pytest.mark.slow

ONE_WAY_MS, JITTER_MS = 5.0, 2.0  # a 10-14 ms round trip: another zone, or a busy node
MAX_TOKENS = 48
ROUNDS = 5  # partition, then drafter restart, each this many times


# Requests whose answers copy their prompts, so that the suffix drafter's drafts pay.
COPYING = [f"Correct any mistakes in the following text and return the full corrected text.\n\n{text}" for text in (
    "Our team moved its build sytem from a single large script to a set of small tasks last month.",
    "The museum's new exhibition shows tools used by farmers over the last three hundred yeras.",
    "Anna is moving from a large city to a small vilage in the mountains, and she wants quieter days.",
    "Each task declares its inputs and outputs, so the build only reruns what changed since the last run.",
)]


def _requests(speculate: bool = True) -> list:
    return [greedy_request(p, MAX_TOKENS, ignore_eos=True, speculate=speculate) for p in COPYING]


def _accepted(target: ServiceProcess) -> float:
    return metric(scrape(target.metrics_url), "tandem_spec_decode_num_accepted_tokens_total")


def _assert_alone(results: list, alone: list) -> None:
    assert [r.token_ids for r in results] == [a.token_ids for a in alone]


def _assert_speculates(target: ServiceProcess, alone: list) -> None:
    """Requests after a fault: the alone's tokens, and drafts accepted again."""
    before = _accepted(target)
    _assert_alone(run_requests(target.address, _requests()), alone)
    assert _accepted(target) > before, "speculation did not come back after the fault"


def _partitioned_round(proxy: ProxyProcess, target: ServiceProcess, alone: list) -> None:
    """The link stops forwarding without closing: requests meanwhile get the alone's tokens, and
    few steps wait for drafts that cannot come."""
    before = scrape(target.metrics_url)
    proxy.partition()
    try:
        _assert_alone(run_requests(target.address, _requests()), alone)
        after = scrape(target.metrics_url)
    finally:
        proxy.heal()

    steps, waited, seconds = waits_between(before, after)
    assert waited <= steps / 4, "most steps waited on a silent link"
    assert seconds < 0.5


def _restart_round(draft: ServiceProcess, target: ServiceProcess, alone: list) -> ServiceProcess:
    """The drafter dies while requests stream through the delayed link, and comes back."""
    results: list = []
    worker = threading.Thread(target=lambda: results.extend(run_requests(target.address, _requests())))
    worker.start()
    time.sleep(1.0)  # mid-stream
    draft.kill()
    worker.join(300)
    _assert_alone(results, alone)
    draft = draft.restarted().wait_healthy()
    wait_connected(target, connected=True)
    return draft


def test_a_delayed_link_that_partitions_and_loses_its_drafter_costs_clients_no_token(tmp_path_factory):
    logs = tmp_path_factory.mktemp("network")
    draft = service_process("draft_service", ["--threads", "1", "--max-model-len", "512", "--drafter", "suffix"],
                            log_path=logs / "draft.log").start()
    proxy = ProxyProcess(draft.address, ONE_WAY_MS, JITTER_MS, log_path=logs / "proxy.log").start()
    # The step floor makes drafts pay on this CPU (see test_service_pair's fault tests), so that the
    # speed guard keeps speculating and its return can be seen; without the target's own lookup, every
    # accepted draft is the drafter's.
    target = service_process("target_service", ["--threads", "1", "--max-model-len", "512", "--drafter",
                                                proxy.address, "--min-step-ms", "30", "--draft-wait-ms", "50",
                                                "--reconnect-max-seconds", "0.3", "--no-local-drafts"],
                             log_path=logs / "target.log").start()
    try:
        draft.wait_healthy()
        target.wait_healthy()
        wait_connected(target)
        alone = run_requests(target.address, _requests(speculate=False))
        _assert_speculates(target, alone)
        for _ in range(ROUNDS):
            _partitioned_round(proxy, target, alone)
            _assert_speculates(target, alone)
        for _ in range(ROUNDS):
            draft = _restart_round(draft, target, alone)
            _assert_speculates(target, alone)
    finally:
        target.kill()
        proxy.terminate()
        draft.kill()
