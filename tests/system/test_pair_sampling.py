"""Lossless end to end: with and without speculation, sampled tokens follow the same distribution."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2_contingency

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
    guesses of the committed tokens are sometimes right) and each target step lasts 20 ms, as a
    larger target's would, so that the pre-drafts are ready in time."""
    root, target_model, draft_model = tiny_models
    root = root / request.param
    root.mkdir()
    if request.param == "cached":
        draft_model = target_model
    if request.param == "reduced-head":
        draft_model = write_tiny_drafter(root / "drafter.safetensors", target_model, draft_model,
                                         list(range(4, 28)))
    draft = service_process("draft_service", ["--model", str(draft_model), "--max-model-len", "64",
                                             "--num-slots", "64", "--max-k", "4", "--probs-top-k", "4"],
                           log_path=root / "draft.log").start()
    # Pre-drafts must be ready within a step: at 16 sequences the drafter keeps up; synchronous
    # pairs batch more, for fewer steps.
    mode = (["--min-step-ms", "20", "--max-num-seqs", "16"] if request.param == "cached"
            else ["--sync-speculation", "--max-num-seqs", "64"])
    target = service_process("target_service", ["--model", str(target_model), *TARGET_ARGS,
                                               "--drafter", draft.address, *mode],
                            log_path=root / "target.log").start()
    draft.wait_healthy()
    target.wait_healthy()
    yield target, CACHED_POSITIONS if request.param == "cached" else POSITIONS
    target.kill()
    draft.kill()


def _sample(target: ServiceProcess, speculate: bool, positions: int) -> tuple[np.ndarray, int]:
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=PROMPT),
        sampling_params=generation_pb2.SamplingParams(temperature=1.0, max_tokens=positions, speculate=speculate,
                                                      ignore_eos=True, num_speculative_tokens=2),
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
        assert drafts >= SAMPLES, "too few drafts were verified for the test to mean anything"
    for position in range(positions):
        counts = np.stack([np.bincount(plain[:, position], minlength=VOCAB),
                           np.bincount(speculative[:, position], minlength=VOCAB)])
        counts = counts[:, counts.sum(axis=0) > 0]
        assert counts.shape[1] > 3, "the distribution is too peaked to test"
        assert chi2_contingency(counts).pvalue > 1e-3, f"position {position}"
    pairs = [plain[:, 0] * VOCAB + plain[:, 1], speculative[:, 0] * VOCAB + speculative[:, 1]]
    table = np.stack([np.bincount(p, minlength=VOCAB * VOCAB) for p in pairs])
    frequent = table.sum(axis=0) >= 20  # pool rare pairs so expected counts stay large enough
    pooled = np.concatenate([table[:, frequent], table[:, ~frequent].sum(axis=1, keepdims=True)], axis=1)
    assert chi2_contingency(pooled).pvalue > 1e-3, "joint of the first two tokens"
