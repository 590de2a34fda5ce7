"""Starting the services as real processes on loopback: for the demo, the tests and the benchmarks."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.metrics_scrape import metric, scrape
from tandem.tls import ClientTls

POLL_BACKOFF_MS = 200  # how often wait_healthy's channel retries a service not yet listening


_handed_out: set[int] = set()  # ports free_port gave this process
_handing_out = threading.Lock()
# Below Linux's default ephemeral range (32768-60999): the kernel gives those to every process's
# outgoing connections and bind(0), so a port found free there may be taken before the service binds it.
PORT_RANGE = range(20000, 32768)
_ports = random.SystemRandom()  # not the global generator, which a test may seed alike in every worker


def cpu_seconds(pid: int | str = "self", thread: int | None = None) -> float:
    """User plus system CPU time so far of a live process (all its threads), or of one of its
    threads, from Linux's /proc."""
    path = Path(f"/proc/{pid}") if thread is None else Path(f"/proc/{pid}/task/{thread}")
    fields = (path / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A loopback port free now, outside the ephemeral range, never handed out before by this process.
    Chosen at random, so that processes picking ports at once (test workers) rarely pick the same."""
    with _handing_out:
        while True:
            port = _ports.choice(PORT_RANGE)
            if port in _handed_out:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port


@dataclass
class ServiceProcess:
    """A service started as `python -m module --port ... --metrics-port ... args`."""

    module: str
    args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    log_path: Path | None = None
    process: subprocess.Popen | None = None
    tls: ClientTls | None = None  # how wait_healthy reaches a service started with --tls-cert
    http_port: int = 0  # a target's OpenAI HTTP API (--http-port); 0: off

    def channel(self) -> grpc.Channel:
        """A blocking channel to the service, over TLS when `tls` is set.

        It retries a refused connect every POLL_BACKOFF_MS, not on gRPC's default backoff (1 s, then
        growing), which would find a service that started listening seconds late.
        """
        options = [("grpc.initial_reconnect_backoff_ms", POLL_BACKOFF_MS),
                   ("grpc.min_reconnect_backoff_ms", POLL_BACKOFF_MS),
                   ("grpc.max_reconnect_backoff_ms", POLL_BACKOFF_MS)]
        if self.tls is None:
            return grpc.insecure_channel(self.address, options=options)
        return grpc.secure_channel(self.address, self.tls.credentials(), options=options)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """The OpenAI API's base URL, as the OpenAI SDK takes it."""
        return f"http{'s' if self.tls else ''}://127.0.0.1:{self.http_port}/v1"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> "ServiceProcess":
        cmd = [sys.executable, "-m", self.module, "--port", str(self.port),
               "--metrics-port", str(self.metrics_port), *self.args]
        if self.http_port:
            cmd += ["--http-port", str(self.http_port)]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_healthy(self, timeout: float = 120.0) -> "ServiceProcess":
        deadline = time.monotonic() + timeout
        with self.channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.module} exited with {self.process.returncode}; see {self.log_path}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"{self.module} on {self.address} was not healthy within {timeout:.0f} s")

    def wait_metric(self, name: str, value: float, timeout: float = 120.0) -> "ServiceProcess":
        """Until the service's /metrics shows `name` (unlabelled) at `value`: tandem_drafter_connected 1, say."""
        deadline = time.monotonic() + timeout
        while metric(scrape(self.metrics_url), name) != value:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.module} on {self.address}: {name} did not reach {value} in {timeout:.0f} s")
            time.sleep(0.2)
        return self

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited in time; returns the exit code."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restarted(self) -> "ServiceProcess":
        """The same service started again, on the same ports and log, after this one was stopped."""
        return ServiceProcess(self.module, self.args, port=self.port, metrics_port=self.metrics_port,
                              log_path=self.log_path, tls=self.tls, http_port=self.http_port).start()


@dataclass
class GatewayProcess:
    """The Shepherd Model Gateway (`smg launch`, the `gateway` extra) in front of targets' gRPC ports,
    speaking vLLM's engine protocol to them: for the tests and the benchmarks."""

    worker_addresses: list[str]
    log_path: Path
    port: int = field(default_factory=free_port)
    policy: str = "round_robin"
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "GatewayProcess":
        """Health checks every second, a worker out after two failures: the tests kill targets."""
        smg = Path(sys.executable).with_name("smg")
        command = [str(smg), "launch", "--host", "127.0.0.1", "--port", str(self.port), "--backend", "vllm",
                   "--worker-urls", *(f"grpc://{a}" for a in self.worker_addresses), "--policy", self.policy,
                   "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
                   "--health-check-interval-secs", "1", "--health-failure-threshold", "2", "--log-level", "warn"]
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, model: str, timeout: float = 120.0) -> "GatewayProcess":
        """Until every worker is ready and a chat completion through the gateway succeeds (its
        tokenizer, from a worker's GetTokenizer, is loaded)."""
        deadline = time.monotonic() + timeout
        probe = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"smg exited with {self.process.returncode}; see {self.log_path}")
            try:
                if len(self.ready_workers()) == len(self.worker_addresses):
                    request = urllib.request.Request(f"{self.url}/v1/chat/completions", data=probe.encode(),
                                                     headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(request, timeout=30):
                        return self
            except OSError:  # not listening yet, or 503 while it has no worker (HTTPError is an OSError)
                pass
            time.sleep(0.5)
        raise TimeoutError(f"smg did not route to {len(self.worker_addresses)} workers in {timeout:.0f} s; "
                           f"see {self.log_path}")

    def ready_workers(self) -> list[dict]:
        """The workers the gateway's /workers lists as ready to route to."""
        with urllib.request.urlopen(f"{self.url}/workers", timeout=5) as reply:
            workers = json.load(reply)["workers"]
        return [w for w in workers if w["status"] == "ready" and w["is_healthy"]]

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
