"""An idle service takes no core from a busy one: after its last step, its threads sleep."""
from __future__ import annotations

import os
import time

import pytest

from tests.support.service_fixtures import greedy_request, run_requests
from tandem.launch import ServiceProcess, cpu_seconds

# CPU seconds the whole process may use while idle over the window: the gRPC and metrics threads'
# housekeeping only. A spinning thread would use about the window itself.
IDLE_WINDOW_SECONDS = 2.0
IDLE_CPU_SECONDS = 0.1


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_an_idle_target_with_two_threads_uses_no_cpu(tmp_path):
    target = ServiceProcess("target_service", ["--model", "smollm2-135m", "--threads", "2", "--max-model-len", "512"],
                            log_path=tmp_path / "target.log").start()
    try:
        target.wait_healthy(300)
        results = run_requests(target.address, [greedy_request("Count from one to ten.", 24)] * 2)
        assert all(len(r.token_ids) == 24 for r in results)
        time.sleep(0.5)  # the pool spins 0.2 ms after a forward; everything should sleep by now
        before = cpu_seconds(target.process.pid)
        time.sleep(IDLE_WINDOW_SECONDS)
        used = cpu_seconds(target.process.pid) - before
        assert used <= IDLE_CPU_SECONDS, f"an idle target used {used:.2f} CPU seconds in {IDLE_WINDOW_SECONDS} s"
    finally:
        target.terminate(10)
