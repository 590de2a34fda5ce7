"""The pair as real processes on loopback: greedy identity, TTFT under a slow drafter, drafter faults."""
from __future__ import annotations

import signal
import statistics
import threading
import time


from tests.support.pairs import TWO_THREADS, pair_fixture, start_pair, wait_connected, waits_between
from tests.support.service_fixtures import PROMPTS, greedy_request, metric, run_requests, scrape
from tandem.launch import ServiceProcess

MAX_TOKENS = 24
DRAFTER_ONLY = ["--no-local-drafts"]  # every draft verified is the drafter's, so its return can be seen
COPYING = ("Correct any mistakes in the following text and return the full corrected text.\n\n"
           "Our team moved its build sytem from a single large script to a set of small tasks last month.")


def _greedy_identity(target: ServiceProcess) -> None:
    before = scrape(target.metrics_url)
    alone = run_requests(target.address, [greedy_request(p, MAX_TOKENS, speculate=False) for p in PROMPTS])
    speculative = run_requests(target.address, [greedy_request(p, MAX_TOKENS) for p in PROMPTS])
    for prompt, a, s in zip(PROMPTS, alone, speculative):
        assert s.token_ids == a.token_ids, prompt
        assert s.text == a.text
        assert a.draft_tokens == 0
    after = scrape(target.metrics_url)
    accepted = metric(after, "tandem_spec_decode_num_accepted_tokens_total") - metric(
        before, "tandem_spec_decode_num_accepted_tokens_total")
    assert accepted > 0, "no draft was ever accepted: speculation did not run"
    assert accepted == sum(s.accepted_tokens for s in speculative)


def test_greedy_with_ngram_drafter_is_token_identical(ngram_pair):
    _greedy_identity(ngram_pair[1])


def test_greedy_with_model_drafter_is_token_identical(model_pair):
    _greedy_identity(model_pair[1])


def test_a_target_that_keeps_no_predrafts_is_sent_none(model_pair):
    """The synchronous baseline opens its sequences without accepts_assumed: the drafter drafts
    only for the committed prefixes it is told, as before the speculation cache."""
    draft, target = model_pair
    run_requests(target.address, [greedy_request(p, MAX_TOKENS) for p in PROMPTS[:2]])
    drafter_samples, target_samples = scrape(draft.metrics_url), scrape(target.metrics_url)
    assert any(s.name == "tandem_draft_predraft_proposals_total" for s in drafter_samples)
    assert metric(drafter_samples, "tandem_draft_proposals_total") > 0
    assert metric(drafter_samples, "tandem_draft_predraft_proposals_total") == 0
    assert metric(target_samples, "tandem_draft_rejected_proposals_total", reason="base_len") == 0


suffix_pair = pair_fixture("suffix", TWO_THREADS)
suffix_model_pair = pair_fixture("suffix+model", ["--sync-speculation", *TWO_THREADS], TWO_THREADS)


def test_greedy_with_suffix_drafter_is_token_identical(suffix_pair):
    _greedy_identity(suffix_pair[1])


def test_suffix_in_front_of_the_model_is_lossless_and_its_point_masses_are_verified(suffix_model_pair):
    """Its suffix drafts carry one-entry q' rows under the model's announced K: the target takes them."""
    draft, target = suffix_model_pair
    _greedy_identity(target)
    before = scrape(target.metrics_url)
    sampled = [greedy_request(p, MAX_TOKENS) for p in PROMPTS]
    for seed, request in enumerate(sampled):
        request.sampling_params.temperature, request.sampling_params.seed = 0.8, seed
    results = run_requests(target.address, sampled)
    after = scrape(target.metrics_url)
    assert all(r.token_ids for r in results)
    assert metric(scrape(draft.metrics_url), "tandem_draft_suffix_proposals_total") > 0
    assert metric(after, "tandem_draft_rejected_proposals_total", reason="probs") \
        == metric(before, "tandem_draft_rejected_proposals_total", reason="probs")
    assert sum(r.draft_tokens for r in results) > 0 and sum(r.accepted_tokens for r in results) > 0


# The asynchronous default: sequences opened for pre-drafts, the target caching them. Two things
# must hold for a step to find a pre-draft, whatever the machine: the drafter needs scratch slots
# beside the 8 sequences' own (one per outcome), and its fresh and pre-draft rounds must end
# within the target's step. On a slow CPU the distilled drafter's rounds outlast SmolLM2's 15 ms
# step, and the policy rightly stops waiting for drafts; a step of at least 150 ms stands in for
# the larger target that speculation is for.
cached_pair = pair_fixture("model", ["--dtype", "bfloat16", "--min-step-ms", "150"], ["--num-slots", "64"])


def test_greedy_with_cached_pre_drafts_is_token_identical(cached_pair):
    draft, target = cached_pair
    before = scrape(target.metrics_url)
    _greedy_identity(target)
    after_target, after_draft = scrape(target.metrics_url), scrape(draft.metrics_url)
    hits = (metric(after_target, "tandem_draft_cache_hits_total")
            - metric(before, "tandem_draft_cache_hits_total"))
    assert metric(after_draft, "tandem_draft_predraft_proposals_total") > 0
    assert hits > 0, "no step verified a pre-draft: the cache was not exercised"


def test_ttft_does_not_wait_for_a_slow_drafter(tmp_path_factory):
    draft, target = start_pair(tmp_path_factory, "slow", ["--drafter", "ngram", "--delay-ms", "500"])
    try:
        ttft = {True: [], False: []}
        outputs = {True: [], False: []}
        for _ in range(3):
            for speculate in (False, True):
                [result] = run_requests(target.address, [greedy_request(PROMPTS[4], 12, speculate=speculate)])
                ttft[speculate].append(result.ttft)
                outputs[speculate].append(result.token_ids)
        assert outputs[True] == outputs[False]
        # The drafter answers 500 ms late; the first token must not wait for it.
        assert statistics.median(ttft[True]) < statistics.median(ttft[False]) * 1.5 + 0.05
    finally:
        target.kill()
        draft.kill()


def test_drafter_killed_and_restarted(tmp_path_factory, ngram_pair):
    # The step floor makes drafts pay here too (see the hung-drafter test): speculation must be seen
    # to resume. The output alone comes from the other pair's target, the same model without the floor.
    [reference] = run_requests(ngram_pair[1].address, [greedy_request(PROMPTS[4], 48, speculate=False)])
    draft, target = start_pair(tmp_path_factory, "faults", ["--drafter", "ngram"],
                               ["--max-num-seqs", "4", "--min-step-ms", "50", "--reconnect-max-seconds", "0.3",
                                *DRAFTER_ONLY])
    try:
        results = []
        worker = threading.Thread(target=lambda: results.extend(
            run_requests(target.address, [greedy_request(PROMPTS[4], 48, ignore_eos=True)] * 4)))
        worker.start()
        time.sleep(1.0)
        draft.kill()
        worker.join(300)
        assert len(results) == 4
        expected = reference.token_ids
        for result in results:
            assert result.token_ids[: len(expected)] == expected
        wait_connected(target, connected=False)

        before = metric(scrape(target.metrics_url), "tandem_spec_decode_num_accepted_tokens_total")
        draft = draft.restarted().wait_healthy()
        wait_connected(target, connected=True)
        [again] = run_requests(target.address, [greedy_request(PROMPTS[4], 48)])
        assert again.token_ids == expected
        after = metric(scrape(target.metrics_url), "tandem_spec_decode_num_accepted_tokens_total")
        assert after > before, "speculation did not resume after the drafter came back"
    finally:
        target.kill()
        draft.kill()


def test_a_hung_drafter_makes_no_step_wait_and_speculation_resumes_when_it_answers(tmp_path_factory, ngram_pair):
    """SIGSTOP: the drafter stays connected but answers nothing. Steps must soon stop waiting for it.

    The target's 50 ms step floor stands in for a target whose steps make drafts pay: on a CPU
    where a verify costs several decode steps the policy would pause the drafter, and a 48-token
    request might then hold no exploring step (one in 64) to show that speculation resumed."""
    draft, target = start_pair(tmp_path_factory, "hung", ["--drafter", "ngram"],
                               ["--draft-wait-ms", "50", "--min-step-ms", "50", *DRAFTER_ONLY])
    request = greedy_request(PROMPTS[4], 48, ignore_eos=True)
    try:
        [alone] = run_requests(ngram_pair[1].address, [greedy_request(PROMPTS[4], 48, ignore_eos=True,
                                                                      speculate=False)])
        [warm] = run_requests(target.address, [request])
        assert warm.token_ids == alone.token_ids and warm.draft_tokens > 0
        before = scrape(target.metrics_url)
        draft.process.send_signal(signal.SIGSTOP)
        try:
            [hung] = run_requests(target.address, [request])
            after = scrape(target.metrics_url)
        finally:
            draft.process.send_signal(signal.SIGCONT)
        assert hung.token_ids == alone.token_ids

        steps, waited, seconds = waits_between(before, after)
        # Without an answer for longer than a few draft round trips (at least the wait bound),
        # steps stop waiting: a handful of steps wait, and for well under the 0.2 s that allows.
        assert waited <= steps / 4, "most steps waited for a silent drafter"
        assert seconds < 0.5

        wait_connected(target)
        [resumed] = run_requests(target.address, [request])
        assert resumed.token_ids == alone.token_ids
        assert resumed.draft_tokens > 0, "speculation did not resume once the drafter answered again"
    finally:
        target.kill()
        draft.kill()


def test_a_silent_drafter_leaves_a_copying_request_its_own_lookup(tmp_path_factory, ngram_pair):
    """SIGSTOP: the drafter answers nothing. A request that copies its prompt still verifies drafts,
    the target's own lookup of its tokens, and gets the target alone's tokens."""
    [alone] = run_requests(ngram_pair[1].address, [greedy_request(COPYING, 40, speculate=False)])
    draft, target = start_pair(tmp_path_factory, "silent", ["--drafter", "ngram"])
    try:
        draft.process.send_signal(signal.SIGSTOP)
        try:
            [copied] = run_requests(target.address, [greedy_request(COPYING, 40)])
            after = scrape(target.metrics_url)
        finally:
            draft.process.send_signal(signal.SIGCONT)
        assert copied.token_ids == alone.token_ids
        assert copied.accepted_tokens > 0 and metric(after, "tandem_draft_local_total") > 0
        assert metric(after, "tandem_draft_rtt_seconds_count") == 0  # none of the drafts was the drafter's
    finally:
        target.kill()
        draft.kill()


def test_cancel_frees_the_sequence_on_both_services(model_pair):
    import asyncio

    import grpc

    from tandem.v1 import generation_pb2_grpc

    draft, target = model_pair

    async def cancel_midway():
        async with grpc.aio.insecure_channel(target.address) as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(
                greedy_request(PROMPTS[1], 200, ignore_eos=True))
            async for _ in call:
                break
            call.cancel()

    asyncio.run(cancel_midway())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = metric(scrape(target.metrics_url), "tandem_num_requests_running")
        drafting = metric(scrape(draft.metrics_url), "tandem_draft_sequences")
        if running == 0 and drafting == 0:
            break
        time.sleep(0.2)
    assert running == 0 and drafting == 0
