"""Preemption on a real target: a KV pool too small for its concurrent requests preempts the newest,
which recomputes its KV when readmitted, and every request still gives the target alone's tokens."""
from __future__ import annotations

from tandem.launch import ServiceProcess, free_port
from tandem.metrics_scrape import metric, scrape
from tests.support.service_fixtures import greedy_request, run_requests

PROMPTS = ["Count from one to forty in words, separated by commas.",
           "List the days of the week, then list them again backwards.",
           "Write the alphabet with a word for each letter.",
           "Repeat the word 'tandem' twenty times, then say why."]


def test_preempted_sequences_recompute_their_kv_and_keep_the_target_alones_tokens(shared_drafter, tmp_path):
    """256 positions of KV (16 blocks) and 4 slots; each request may reach about 150 positions, so
    four at once run the pool dry. No prefix cache: a preempted sequence's new slot holds nothing."""
    target = ServiceProcess("target_service", [
        "--threads", "1", "--max-model-len", "256", "--kv-cache-tokens", "256", "--max-num-seqs", "4",
        "--no-prefix-caching", "--drafter", shared_drafter.address],
        log_path=tmp_path / "target.log", http_port=free_port()).start()
    try:
        target.wait_healthy().wait_metric("tandem_drafter_connected", 1)
        alone = run_requests(target.address, [greedy_request(p, 100, speculate=False) for p in PROMPTS],
                             concurrency=1)
        assert metric(scrape(target.metrics_url), "tandem_num_preemptions_total") == 0
        together = run_requests(target.address, [greedy_request(p, 100) for p in PROMPTS])
        samples = scrape(target.metrics_url)
    finally:
        target.kill()
    assert metric(samples, "tandem_num_preemptions_total") > 0, "the pool never ran dry: the test proves nothing"
    assert metric(samples, "vllm:num_preemptions_total") == metric(samples, "tandem_num_preemptions_total")
    assert sum(r.accepted_tokens for r in together) > 0, "speculation ran"
    for mine, reference in zip(together, alone):
        assert mine.token_ids == reference.token_ids
