"""Several of each: a target with several drafters (lists, dns:/// names, failover), clients over target replicas."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.support.service_fixtures import PROMPTS, greedy_request, metric, run_requests, scrape, service_process
from target_service.config import TargetConfig
from target_service.speculation.addresses import Candidate, DrafterAddresses, HostPort
from tandem.launch import ServiceProcess

COMMON = ["--threads", "1", "--max-model-len", "512"]
# Targets that must be seen to speculate: steps of at least 150 ms (a larger target) make verifying
# drafts cost no more than decoding, so the policy verifies the n-gram drafts even on a CPU where a
# verify step of SmolLM2 costs several decode steps. PROMPTS[4] asks for a repeat: n-gram matches.
SPECULATING = [*COMMON, "--max-num-seqs", "4", "--min-step-ms", "150"]
SPECULATED_PROMPTS = PROMPTS[1:5]
FAILOVER_TOKENS = 32  # 4.8 s at 150 ms a step: the drafter dies 0.5 s in, mid-generation


@pytest.mark.parametrize("spec, endpoints, dns", [
    ("127.0.0.1:50052", [HostPort("127.0.0.1", 50052)], False),
    ("a:1, b:2", [HostPort("a", 1), HostPort("b", 2)], False),
    ("[::1]:7,draft-0.draft:50052", [HostPort("::1", 7), HostPort("draft-0.draft", 50052)], False),
    ("dns:///draft.tandem.svc:50052", [HostPort("draft.tandem.svc", 50052)], True),
])
def test_drafter_specs(spec, endpoints, dns):
    parsed = DrafterAddresses.parse(spec)
    assert list(parsed.endpoints) == endpoints and parsed.dns == dns


@pytest.mark.parametrize("spec", ["draft", "draft:0", "draft:70000", "a:1,,b:2", "http://draft:1", "dns:///draft"])
def test_bad_drafter_specs_are_refused_with_the_flag(spec):
    with pytest.raises(ValueError, match="--drafter"):
        TargetConfig(drafter=spec)


def test_a_dns_name_resolves_to_every_address_with_its_name_for_tls():
    candidates = asyncio.run(DrafterAddresses.parse("dns:///localhost:50052").resolve())
    assert Candidate("127.0.0.1:50052", "localhost") in candidates
    assert asyncio.run(DrafterAddresses.parse("dns:///no-such-host.invalid:1").resolve()) == []
    assert [c.address for c in asyncio.run(DrafterAddresses.parse("[::1]:5,a:1").resolve())] == ["[::1]:5", "a:1"]


def _streams(draft: ServiceProcess) -> float:
    return metric(scrape(draft.metrics_url), "tandem_draft_streams")


def _wait(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def two_drafters(tmp_path):
    drafters = [service_process("draft_service", ["--drafter", "ngram", "--threads", "1"],
                               log_path=tmp_path / f"draft-{i}.log").start() for i in range(2)]
    for draft in drafters:
        draft.wait_healthy()
    yield drafters
    for draft in drafters:
        draft.kill()


def test_a_target_fails_over_to_its_other_drafter_and_clients_see_nothing(two_drafters, tmp_path, front_doors):
    """The output alone comes from another target of the same model, without the slow steps."""
    alone = run_requests(front_doors.address,
                         [greedy_request(p, FAILOVER_TOKENS, speculate=False) for p in SPECULATED_PROMPTS])
    addresses = ",".join(d.address for d in two_drafters)
    target = service_process("target_service", [*SPECULATING, "--drafter", addresses],
                            log_path=tmp_path / "target.log").start()
    try:
        target.wait_healthy()
        target.wait_metric("tandem_drafter_connected", 1.0)
        [first] = [d for d in two_drafters if _streams(d) == 1]
        [other] = [d for d in two_drafters if d is not first]

        results = []
        clients = threading.Thread(target=lambda: results.extend(
            run_requests(target.address, [greedy_request(p, FAILOVER_TOKENS) for p in SPECULATED_PROMPTS])))
        clients.start()
        time.sleep(0.5)
        first.kill()  # mid-generation
        clients.join(timeout=300)
        assert [r.token_ids for r in results] == [a.token_ids for a in alone]

        _wait(lambda: _streams(other) == 1, "the target's stream on the other drafter")
        before = scrape(target.metrics_url)
        again = run_requests(target.address, [greedy_request(p, FAILOVER_TOKENS) for p in SPECULATED_PROMPTS])
        after = scrape(target.metrics_url)
        assert [r.token_ids for r in again] == [a.token_ids for a in alone]
        accepted = (metric(after, "tandem_spec_decode_num_accepted_tokens_total")
                    - metric(before, "tandem_spec_decode_num_accepted_tokens_total"))
        assert accepted > 0, "speculation did not resume on the other drafter"
    finally:
        target.kill()


def test_a_dns_name_finds_the_drafter(two_drafters, tmp_path):
    port = two_drafters[0].port
    target = service_process("target_service", [*COMMON, "--drafter", f"dns:///localhost:{port}"],
                            log_path=tmp_path / "target.log").start()
    try:
        target.wait_healthy()
        target.wait_metric("tandem_drafter_connected", 1.0)
        assert _streams(two_drafters[0]) == 1 and _streams(two_drafters[1]) == 0
    finally:
        target.kill()


def test_a_client_spreads_its_calls_round_robin_over_target_replicas(front_doors, ngram_pair):
    """tandem.client's channels balance over every address a target name resolves to: here two
    running targets of the same model."""
    targets = [front_doors, ngram_pair[1]]

    def served() -> list[float]:
        return [sum(s.value for s in scrape(t.metrics_url) if s.name == "tandem_request_success_total")
                for t in targets]

    before = served()
    both = "ipv4:" + ",".join(f"127.0.0.1:{t.port}" for t in targets)
    results = run_requests(both, [greedy_request(PROMPTS[0], 2)] * 12, concurrency=1)
    assert all(len(r.token_ids) == 2 for r in results)
    counts = [after - start for after, start in zip(served(), before)]
    # Round-robin alternates over the replicas that are READY: while the second one still
    # connects, the first calls go to the first (pick_first would send all 12 there).
    assert sum(counts) == 12 and min(counts) >= 3, counts


def test_two_targets_share_one_drafter(two_drafters, tmp_path, front_doors):
    """The output alone comes from another target of the same model, without the slow steps."""
    alone = run_requests(front_doors.address, [greedy_request(p, 32, speculate=False) for p in SPECULATED_PROMPTS])
    draft = two_drafters[0]
    targets = [service_process("target_service", [*SPECULATING, "--drafter", draft.address],
                              log_path=tmp_path / f"target-{i}.log").start() for i in range(2)]
    try:
        for target in targets:
            target.wait_healthy()
            target.wait_metric("tandem_drafter_connected", 1.0)
        _wait(lambda: _streams(draft) == 2, "a stream from each target")
        requests = [greedy_request(p, 32) for p in SPECULATED_PROMPTS]
        results: dict[int, list] = {}

        def serve(i: int) -> None:
            results[i] = run_requests(targets[i].address, requests)

        workers = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=300)
        for i in range(2):
            assert [r.token_ids for r in results[i]] == [a.token_ids for a in alone]
            assert sum(r.accepted_tokens for r in results[i]) > 0, f"target {i} verified no drafts"
    finally:
        for target in targets:
            target.kill()
