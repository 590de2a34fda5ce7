"""Lossless end to end: with and without speculation, sampled tokens follow the same distribution."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from bench.delay_proxy import ProxyProcess
from tests.support.service_fixtures import metric, run_requests, scrape, service_process
from tandem.launch import ServiceProcess
from tandem.v1 import generation_pb2
from tests.support.tiny_checkpoint import VOCAB, write_tiny_drafter, write_tiny_model

SAMPLES = 1500
POSITIONS = 3
# With the cache, the first verify step verifies a fresh proposal; pre-drafts serve the later
# steps, so that variant generates (and tests) further.
CACHED_POSITIONS = 6
PROMPT = [3, 17, 9, 25, 4]
# A run makes about 30 chi-square tests of equal distributions: at this floor a correct pair fails one
# run in about 300, where 1e-3 failed one in 30. A lossy step still fails by orders of magnitude.
SAME_DISTRIBUTION_P = 1e-4


TARGET_ARGS = ["--max-model-len", "64", "--max-queue", "4096"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """(folder, target, drafter): two tiny models, so that q is far from p."""
    root = tmp_path_factory.mktemp("tiny")
    return root, write_tiny_model(root / "target", seed=0), write_tiny_model(root / "draft", seed=1)


@pytest.fixture(scope="module")
def plain(tiny_models):
    """The target alone's samples, CACHED_POSITIONS tokens each: every variant compares with them."""
    root, target_model, _ = tiny_models
    target = service_process("target_service", ["--model", str(target_model), *TARGET_ARGS, "--max-num-seqs", "64"],
                             log_path=root / "alone.log").start()
    try:
        tokens, drafts = _sample(target.wait_healthy(), speculate=False, positions=CACHED_POSITIONS)
    finally:
        target.kill()
    assert drafts == 0
    return tokens


@pytest.fixture(scope="module", params=["checkpoint", "reduced-head", "cached"])
def tiny_pair(tiny_models, request):
    """The drafter is another tiny model (q far from p), or a drafter file with a reduced head on the
    target's embedding, whose q' is zero outside its 24-token draft vocabulary. Both are verified
    synchronously, every draft. "cached" runs the asynchronous default, where steps also verify
    pre-drafts from the speculation cache: its drafter is the target's own model (so that its
    guesses of the committed tokens are sometimes right), with slots for every outcome of 16
    sequences at 4 guesses, and each target step lasts 60 ms, as a larger target's would, so that
    the pre-drafts are ready in time even while the rest of `make test` loads the 2 cores (at 40 ms,
    118 and 120 steps of 1,500 verified pre-drafts in two full runs on a slow box); it reaches its drafter through the delay proxy, 1 ms each way
    with up to 1 ms of jitter, as across nodes."""
    root, target_model, draft_model = tiny_models
    root = root / request.param
    root.mkdir()
    if request.param == "cached":
        draft_model = target_model
    if request.param == "reduced-head":
        draft_model = write_tiny_drafter(root / "drafter.safetensors", target_model, draft_model,
                                         list(range(4, 28)))
    slots = ["--num-slots", "160", "--predraft-guesses", "4"] if request.param == "cached" else ["--num-slots", "64"]
    draft = service_process("draft_service", ["--drafter", "model", "--model", str(draft_model), "--max-model-len", "64",
                                             *slots, "--max-k", "4", "--probs-top-k", "4"],
                           log_path=root / "draft.log").start()
    # Pre-drafts must be ready within a step: at 16 sequences the drafter keeps up; synchronous
    # pairs batch more, for fewer steps.
    mode = (["--min-step-ms", "60", "--max-num-seqs", "16"] if request.param == "cached"
            else ["--sync-speculation", "--max-num-seqs", "64"])
    link = draft
    if request.param == "cached":
        link = ProxyProcess(draft.address, 1.0, 1.0, log_path=root / "proxy.log").start()
    target = service_process("target_service", ["--model", str(target_model), *TARGET_ARGS,
                                               "--drafter", link.address, *mode],
                            log_path=root / "target.log").start()
    draft.wait_healthy()
    target.wait_healthy()
    yield target, CACHED_POSITIONS if request.param == "cached" else POSITIONS
    target.kill()
    if link is not draft:
        link.terminate()
    draft.kill()


def _sample(target: ServiceProcess, speculate: bool, positions: int, **rules) -> tuple[np.ndarray, int]:
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=PROMPT),
        sampling_params=generation_pb2.SamplingParams(temperature=1.0, max_tokens=positions, speculate=speculate,
                                                      ignore_eos=True, num_speculative_tokens=2, **rules),
    )
    results = run_requests(target.address, [request] * SAMPLES)
    tokens = np.array([r.token_ids for r in results])  # [SAMPLES, POSITIONS]
    return tokens, sum(r.draft_tokens for r in results)


def test_first_tokens_follow_the_same_distribution_with_and_without_speculation(tiny_pair, plain, request):
    target, positions = tiny_pair
    plain = plain[:, :positions]
    hits_before = metric(scrape(target.metrics_url), "tandem_draft_cache_hits_total")
    speculative, drafts = _sample(target, speculate=True, positions=positions)
    hits = metric(scrape(target.metrics_url), "tandem_draft_cache_hits_total") - hits_before
    if request.node.callspec.params["tiny_pair"] == "cached":
        assert hits >= SAMPLES // 10, f"only {hits:.0f} steps verified pre-drafts: the cache was barely exercised"
        assert drafts >= SAMPLES // 2, "too few drafts were verified for the test to mean anything"
    else:
        assert hits == 0
        # Each request verifies one draft, unless a drafter round outlasted the synchronous target's
        # 1 s bound for one of its steps (a loaded box): most must be verified, not every one.
        assert drafts >= SAMPLES * 9 // 10, "too few drafts were verified for the test to mean anything"
    _assert_same_distribution(plain, speculative, positions)


# Penalties that bite on a 32-token vocabulary, a bias, and a stop token (banned by min_tokens at every
# position).
RULES = dict(frequency_penalty=0.8, presence_penalty=0.6, repetition_penalty=1.8, logit_bias={19: -3.0, 9: 1.5},
             stop_token_ids=[7])


def test_with_penalties_a_bias_and_min_tokens_the_distribution_is_still_the_target_alones(tiny_pair, plain):
    """Each verified position is processed with the drafts before it counted; the drafter applies the
    same rules, so its drafts are still accepted."""
    target, positions = tiny_pair
    plain = plain[:, :positions]
    alone, _ = _sample(target, speculate=False, positions=positions, min_tokens=positions, **RULES)
    speculative, drafts = _sample(target, speculate=True, positions=positions, min_tokens=positions, **RULES)
    assert drafts >= SAMPLES // 2, "too few drafts were verified for the test to mean anything"
    assert (plain == 7).any() and not (alone == 7).any() and not (speculative == 7).any(), "min_tokens bans it"
    for position in range(positions):  # the rules change the distribution that the pair must match
        counts = np.stack([np.bincount(plain[:, position], minlength=VOCAB),
                           np.bincount(alone[:, position], minlength=VOCAB)])
        assert chi2_contingency(counts[:, counts.sum(axis=0) > 0]).pvalue < 1e-6, f"position {position}"
    _assert_same_distribution(alone, speculative, positions)


def _assert_same_distribution(plain: np.ndarray, speculative: np.ndarray, positions: int) -> None:
    """Each position's marginal, and the joint of the first two, by chi-square tests."""
    for position in range(positions):
        counts = np.stack([np.bincount(plain[:, position], minlength=VOCAB),
                           np.bincount(speculative[:, position], minlength=VOCAB)])
        counts = counts[:, counts.sum(axis=0) > 0]
        assert counts.shape[1] > 3, "the distribution is too peaked to test"
        assert chi2_contingency(counts).pvalue > SAME_DISTRIBUTION_P, f"position {position}"
    pairs = [plain[:, 0] * VOCAB + plain[:, 1], speculative[:, 0] * VOCAB + speculative[:, 1]]
    table = np.stack([np.bincount(p, minlength=VOCAB * VOCAB) for p in pairs])
    frequent = table.sum(axis=0) >= 20  # pool rare pairs so expected counts stay large enough
    pooled = np.concatenate([table[:, frequent], table[:, ~frequent].sum(axis=1, keepdims=True)], axis=1)
    assert chi2_contingency(pooled).pvalue > SAME_DISTRIBUTION_P, "joint of the first two tokens"
