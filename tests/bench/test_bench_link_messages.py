"""bench.link_messages: a real server and client process per configuration, over loopback gRPC."""
from __future__ import annotations

from bench.link_messages import main


def test_each_configuration_reports_the_cpu_and_round_trip_of_a_message_pair(capsys):
    results = main(["--pairs", "500", "--rounds", "2", "--experiments=", "--experiments=-event_engine_client"])
    assert list(results) == ["", "-event_engine_client"]
    for runs in results.values():
        assert len(runs) == 2
        for figures in runs:
            assert figures["round_trip_us"] > 0
            assert figures["event_loop_us"] + figures["other_threads_us"] > 0
    assert "GRPC_EXPERIMENTS=-event_engine_client: client CPU" in capsys.readouterr().out
