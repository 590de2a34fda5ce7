"""Lossless end to end: with and without speculation, sampled tokens follow the same distribution."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from service_fixtures import run_requests
from tandem.launch import ServiceProcess
from tandem.v1 import generation_pb2
from tiny_checkpoint import VOCAB, write_tiny_drafter, write_tiny_model

SAMPLES = 1500
POSITIONS = 3
PROMPT = [3, 17, 9, 25, 4]


@pytest.fixture(scope="module", params=["checkpoint", "reduced-head"])
def tiny_pair(tmp_path_factory, request):
    """The drafter is another tiny model (q far from p), or a drafter file with a reduced head on the
    target's embedding, whose q' is zero outside its 24-token draft vocabulary."""
    root = tmp_path_factory.mktemp("tiny")
    target_model = write_tiny_model(root / "target", seed=0)
    draft_model = write_tiny_model(root / "draft", seed=1)
    if request.param == "reduced-head":
        draft_model = write_tiny_drafter(root / "drafter.safetensors", target_model, draft_model,
                                         list(range(4, 28)))
    draft = ServiceProcess("draft_service", ["--model", str(draft_model), "--max-model-len", "64",
                                             "--num-slots", "16", "--max-k", "4", "--probs-top-k", "4"],
                           log_path=root / "draft.log").start()
    target = ServiceProcess("target_service", ["--model", str(target_model), "--max-model-len", "64",
                                               "--max-num-seqs", "16", "--max-queue", "4096",
                                               "--drafter", draft.address, "--sync-speculation"],
                            log_path=root / "target.log").start()
    draft.wait_healthy()
    target.wait_healthy()
    yield target
    target.kill()
    draft.kill()


def _sample(target: ServiceProcess, speculate: bool) -> tuple[np.ndarray, int]:
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=PROMPT),
        sampling_params=generation_pb2.SamplingParams(temperature=1.0, max_tokens=POSITIONS, speculate=speculate, ignore_eos=True,
                                                      num_speculative_tokens=2),
    )
    results = run_requests(target.address, [request] * SAMPLES)
    tokens = np.array([r.token_ids for r in results])  # [SAMPLES, POSITIONS]
    return tokens, sum(r.draft_tokens for r in results)


def test_first_tokens_follow_the_same_distribution_with_and_without_speculation(tiny_pair):
    plain, plain_drafts = _sample(tiny_pair, speculate=False)
    speculative, drafts = _sample(tiny_pair, speculate=True)
    assert plain_drafts == 0
    assert drafts >= SAMPLES, "too few drafts were verified for the test to mean anything"
    for position in range(POSITIONS):
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
