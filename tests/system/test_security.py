"""TLS on the client link, mTLS on the drafter link, and the bearer token, with real processes.

One mTLS drafter; three targets: one with the right client certificate (and TLS plus a token for
its clients), one with no client certificate (and mTLS for its clients), one with a certificate
from another CA. The drafter must take only the first.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.cert_factory import TestCA
from tests.support.service_fixtures import PROMPTS, call_error, greedy_request, metric, run_requests, scrape
from tandem.launch import ServiceProcess
from tandem.tls import ClientTls, bearer_metadata
from tandem.v1 import generation_pb2, generation_pb2_grpc

TOKEN = "s3cret-token"
BASE = ["--threads", "1", "--max-model-len", "512", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca, rogue = TestCA(folder, "tandem-ca"), TestCA(folder, "rogue-ca")
    token_file = folder / "token"
    token_file.write_text(TOKEN + "\n")
    return dict(ca=ca, server=ca.issue("server"), target=ca.issue("target"), client=ca.issue("client"),
                rogue_target=rogue.issue("target"), token_file=str(token_file))


@pytest.fixture(scope="module")
def services(pki, tmp_path_factory):
    logs = tmp_path_factory.mktemp("security-logs")
    ca, server = pki["ca"], pki["server"]
    tls_server = ["--tls-cert", server.cert, "--tls-key", server.key]
    draft = ServiceProcess("draft_service", ["--drafter", "ngram", "--threads", "1", *tls_server,
                                             "--tls-client-ca", ca.ca_file],
                           log_path=logs / "draft.log",
                           tls=ClientTls(ca.ca_file, pki["target"].cert, pki["target"].key)).start()
    link = ["--drafter", draft.address, "--drafter-ca", ca.ca_file]
    good = ServiceProcess("target_service", [*BASE, *tls_server, "--auth-token-file", pki["token_file"], *link,
                                             "--drafter-client-cert", pki["target"].cert,
                                             "--drafter-client-key", pki["target"].key],
                          log_path=logs / "good.log", tls=ClientTls(ca.ca_file)).start()
    no_cert = ServiceProcess("target_service", [*BASE, *tls_server, "--tls-client-ca", ca.ca_file, *link],
                             log_path=logs / "no_cert.log",
                             tls=ClientTls(ca.ca_file, pki["client"].cert, pki["client"].key)).start()
    rogue = ServiceProcess("target_service", [*BASE, *link, "--drafter-client-cert", pki["rogue_target"].cert,
                                              "--drafter-client-key", pki["rogue_target"].key],
                           log_path=logs / "rogue.log").start()
    processes = dict(draft=draft, good=good, no_cert=no_cert, rogue=rogue)
    try:
        for process in processes.values():
            process.wait_healthy(timeout=300)
        yield processes
    finally:
        for process in processes.values():
            process.kill()


def _wait_connected(target: ServiceProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(scrape(target.metrics_url), "tandem_drafter_connected") != 1:
        assert time.monotonic() < deadline, "the target never connected to its drafter"
        time.sleep(0.3)


def test_mtls_drafter_takes_the_right_target_and_speculation_runs(services, pki):
    good = services["good"]
    _wait_connected(good)
    tls = ClientTls(pki["ca"].ca_file)
    before = scrape(good.metrics_url)
    prompt = PROMPTS[4]  # repetitive: the n-gram drafter has something to propose
    alone = run_requests(good.address, [greedy_request(prompt, 24, speculate=False)], tls=tls, token=TOKEN)
    spec = run_requests(good.address, [greedy_request(prompt, 24)], tls=tls, token=TOKEN)
    assert spec[0].token_ids == alone[0].token_ids
    after = scrape(good.metrics_url)
    drafted = (metric(after, "tandem_spec_decode_num_draft_tokens_total")
               - metric(before, "tandem_spec_decode_num_draft_tokens_total"))
    assert drafted > 0, "no draft was verified over the mTLS link"


@pytest.mark.parametrize("name", ["no_cert", "rogue"])
def test_mtls_drafter_refuses_a_target_without_a_cert_from_its_ca(services, pki, name):
    _wait_connected(services["good"])  # the drafter is up and takes the right target
    target = services[name]
    tls = target.tls
    time.sleep(1.0)  # several connection attempts (backoff starts at 0.1 s)
    assert metric(scrape(target.metrics_url), "tandem_drafter_connected") == 0
    # The target serves on without speculation.
    results = run_requests(target.address, [greedy_request(PROMPTS[0], 6)], tls=tls)
    assert len(results[0].token_ids) == 6
    assert results[0].draft_tokens == 0
    assert metric(scrape(target.metrics_url), "tandem_drafter_connected") == 0


def test_drafter_refuses_a_direct_caller_without_a_client_cert(services, pki):
    from tandem.v1 import drafter_pb2, drafter_pb2_grpc

    draft = services["draft"]
    for tls in (ClientTls(pki["ca"].ca_file),
                ClientTls(pki["ca"].ca_file, pki["rogue_target"].cert, pki["rogue_target"].key)):
        with grpc.secure_channel(draft.address, tls.credentials()) as channel:
            with pytest.raises(grpc.RpcError) as err:
                drafter_pb2_grpc.DrafterStub(channel).Info(drafter_pb2.DrafterInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_client_cannot_talk_to_a_tls_target(services):
    err = call_error(services["good"].address, greedy_request(PROMPTS[0], 2), token=TOKEN)
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_client_mtls_target_refuses_a_client_without_a_cert(services, pki):
    err = call_error(services["no_cert"].address, greedy_request(PROMPTS[0], 2), tls=ClientTls(pki["ca"].ca_file))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("token", ["", "wrong", TOKEN + "x", f"{TOKEN[:-1]}"])
def test_a_missing_or_wrong_token_is_unauthenticated(services, pki, token):
    err = call_error(services["good"].address, greedy_request(PROMPTS[0], 2), tls=ClientTls(pki["ca"].ca_file),
                     token=token)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_token_guards_every_method_but_health(services, pki):
    tls = ClientTls(pki["ca"].ca_file)
    with grpc.secure_channel(services["good"].address, tls.credentials()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10, metadata=bearer_metadata(TOKEN))
        assert info.vocab_size > 0
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_the_right_token_generates(services, pki):
    results = run_requests(services["good"].address, [greedy_request(PROMPTS[0], 4)],
                           tls=ClientTls(pki["ca"].ca_file), token=TOKEN)
    assert len(results[0].token_ids) == 4


def test_tandem_generate_cli_speaks_tls_and_token(services, pki, capsys):
    from tandem.cli import main

    with pytest.raises(SystemExit) as code:
        main(["generate", "Hi", "--target", services["good"].address, "--max-tokens", "3",
              "--ca-cert", pki["ca"].ca_file, "--token-file", pki["token_file"]])
    out, err = capsys.readouterr()
    assert code.value.code == 0, err
    # The answer alone on stdout (`tandem generate ... > out.txt`); the statistics line on stderr.
    assert out.strip() and "tok/s" not in out and "TTFT" not in out
    assert "3 tokens" in err and "tok/s" in err
    with pytest.raises(SystemExit) as code:
        main(["generate", "Hi", "--target", services["good"].address, "--max-tokens", "3",
              "--ca-cert", pki["ca"].ca_file, "--token", "nope"])
    assert code.value.code == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_the_healthcheck_probe_follows_the_services_tls(services, pki):
    """Plaintext fails against TLS; the CA verifies; a service requiring mTLS wants a client cert."""
    probe = [sys.executable, str(Path(__file__).parents[2] / "deploy" / "healthcheck.py"), "--timeout", "5"]

    def check(address: str, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([*probe, address, *flags], capture_output=True, text=True, timeout=60)

    good, draft = services["good"].address, services["draft"].address
    assert check(good).returncode == 1
    ok = check(good, "--ca-cert", pki["ca"].ca_file)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    assert check(good, "--ca-cert", pki["ca"].ca_file, "--server-name", "not-the-server").returncode == 1
    assert check(draft, "--ca-cert", pki["ca"].ca_file).returncode == 1
    mtls = check(draft, "--ca-cert", pki["ca"].ca_file, "--client-cert", pki["target"].cert,
                 "--client-key", pki["target"].key)
    assert mtls.returncode == 0 and "SERVING" in mtls.stdout, mtls.stderr
    assert check(draft, "--client-cert", pki["target"].cert).returncode == 2  # half a client identity


@pytest.mark.parametrize("fields, flag", [
    (dict(tls_cert="t.crt"), "--tls-key"),
    (dict(tls_client_ca="ca.crt"), "--tls-client-ca"),
    (dict(drafter_client_cert="c.crt"), "--drafter-client-key"),
    (dict(auth_token="a", auth_token_file="f"), "--auth-token"),
])
def test_half_set_security_flags_are_refused(fields, flag):
    from target_service.config import TargetConfig

    with pytest.raises(ValueError, match=flag):
        TargetConfig(**fields)


def test_security_is_off_by_default_and_on_when_named():
    from target_service.config import TargetConfig

    assert TargetConfig().server_tls() is None and TargetConfig().drafter_link_tls() is None
    assert TargetConfig(drafter_tls=True).drafter_link_tls() == ClientTls()
    assert TargetConfig(drafter_ca="ca.crt").drafter_link_tls() == ClientTls("ca.crt")
