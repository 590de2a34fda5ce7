"""Every Triton kernel equals its PyTorch reference (torch.equal), with shared keyed randomness.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET);
with CUDA the `gpu` variants run the compiled kernels through the public wrappers.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tandem_kernels import (
    VerifyBatch,
    CompressedProbs,
    encode,
    processed_probs,
    rejection_sample,
    sample,
    sample_compressed,
    verify_invariant,
)
from tandem_kernels._triton import INTERPRETED, tl, triton
from tandem_kernels.gumbel import verify_invariant_reference, verify_invariant_triton
from tandem_kernels.random import (
    DRAFT_SALT,
    TARGET_SALT,
    accept_uniforms,
    race_weights,
    random_bits,
    tl_accept_uniform,
    tl_race_weights,
    tl_random_bits,
)
from tandem_kernels.penalties import (
    RowPenalties,
    apply_penalties,
    apply_penalties_reference,
    apply_penalties_triton,
    penalty_entries,
)
from tandem_kernels.rejection import rejection_sample_reference, rejection_sample_triton
from tandem_kernels.sampling import sample_reference, sample_triton
from tests.support.devices import triton_devices

DEVICES = triton_devices(INTERPRETED)
VOCABS = [1, 2, 999, 1024, 4097, 49152]


def _launch(device: str, launcher, public, *args):
    """The kernel launcher on CPU tensors (interpreter), the public wrapper on CUDA tensors."""
    if device == "cpu":
        return launcher(*args)
    def to_cuda(arg):
        if isinstance(arg, (CompressedProbs, VerifyBatch)):
            return type(arg)(*(field.cuda() for field in dataclasses.astuple(arg)))
        return arg.cuda()

    return public(*map(to_cuda, args))


@triton.jit
def _random_kernel(
    bits_ptr, weights_ptr, uniforms_ptr, seeds_ptr, positions_ptr, n, SALT: tl.constexpr, BLOCK: tl.constexpr
):
    b = tl.program_id(0)
    seed = tl.load(seeds_ptr + b)
    position = tl.load(positions_ptr + b)
    offs = tl.arange(0, BLOCK)
    index = offs.to(tl.uint32)
    tl.store(bits_ptr + b * n + offs, tl_random_bits(seed, position, SALT, index).to(tl.int64), mask=offs < n)
    tl.store(weights_ptr + b * n + offs, tl_race_weights(seed, position, SALT, index), mask=offs < n)
    tl.store(uniforms_ptr + b, tl_accept_uniform(seed, position))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("salt", [TARGET_SALT, DRAFT_SALT])
def test_random_twins(device, salt):
    seeds = torch.tensor([0, 1, -5, 2**62 + 3, -(2**63), 2**63 - 1], dtype=torch.int64)
    positions = torch.tensor([0, 7, 2**33 + 5, 100, 4095, 2**63 - 1], dtype=torch.int64)
    n = 300
    bits = torch.empty(6, n, dtype=torch.int64, device=device)
    weights = torch.empty(6, n, device=device)
    uniforms = torch.empty(6, dtype=torch.float64, device=device)
    _random_kernel[(6,)](bits, weights, uniforms, seeds.to(device), positions.to(device), n, SALT=salt, BLOCK=512)
    index = torch.arange(n)
    assert torch.equal(bits.cpu(), random_bits(seeds, positions, salt, index))
    assert torch.equal(weights.cpu(), race_weights(seeds, positions, salt, index))
    assert torch.equal(uniforms.cpu(), accept_uniforms(seeds, positions))


def _rows(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Processed rows mixing plain, greedy, top-k/top-p and min-p parameters."""
    logits = 3 * torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed))
    kind = torch.arange(num_rows) % 4
    return processed_probs(
        logits,
        torch.where(kind == 1, 0.0, 0.8 + 0.2 * kind.float()),
        torch.where(kind == 2, 50, 0),
        torch.where(kind == 2, 0.9, 1.0),
        torch.where(kind == 3, 0.05, 0.0),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_sample_kernel(device, vocab):
    rows = 2 if vocab > 5000 else 8
    probs = _rows(rows, vocab, seed=vocab)
    seeds, positions = torch.arange(rows) * 1_000_003 - 7, torch.arange(rows) + 2**31
    expected = sample_reference(probs, seeds, positions)
    assert torch.equal(_launch(device, sample_triton, sample, probs, seeds, positions).cpu(), expected)


def _batch(vocab: int, num_drafts: list[int], greedy: list[bool], k_top: int, seed: int):
    """A verification batch whose drafts are drawn from q' near p, so some are accepted."""
    cu = torch.tensor(num_drafts).cumsum(0)
    total = int(cu[-1])
    request = torch.repeat_interleave(torch.arange(len(num_drafts)), torch.tensor(num_drafts))
    row_of_draft = torch.arange(total) + request
    p = _rows(total + len(num_drafts), vocab, seed)
    noise = 0.3 * torch.randn(total, vocab, generator=torch.Generator().manual_seed(seed + 1))
    q = encode(torch.softmax(torch.log(p[row_of_draft] + 1e-6) + noise, dim=1), k_top) if total else CompressedProbs(
        torch.zeros(0, k_top, dtype=torch.int32), torch.zeros(0, k_top, dtype=torch.uint16)
    )
    seeds = torch.arange(len(num_drafts)) * 7919 + seed
    positions = torch.arange(len(num_drafts)) * 3 + 11
    local = torch.arange(total) - (cu - torch.tensor(num_drafts))[request]
    drafts = sample_compressed(q, seeds[request], positions[request] + local)
    return VerifyBatch(p, drafts, cu, seeds, positions), q, torch.tensor(greedy)


def _mixed(vocab: int) -> tuple[list[int], list[bool]]:
    """Requests with 0, 1 and 8 drafts, greedy and random, in one batch (fewer for huge vocabularies)."""
    if vocab > 5000:
        return [0, 1, 8], [False, True, False]
    return [0, 1, 8, 8, 1, 0, 3], [False, False, False, True, True, True, False]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("k_top", [1, 16])
def test_rejection_kernel(device, vocab, k_top):
    num_drafts, greedy = _mixed(vocab)
    args = _batch(vocab, num_drafts, greedy, k_top, seed=vocab + k_top)
    expected = rejection_sample_reference(*args)
    result = _launch(device, rejection_sample_triton, rejection_sample, *args)
    assert torch.equal(result.tokens.cpu(), expected.tokens)
    assert torch.equal(result.num_accepted.cpu(), expected.num_accepted)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1, 2, 999])
def test_rejection_kernel_with_the_whole_vocabulary_in_q(device, vocab):
    args = _batch(vocab, [2, 0, 5, 1], [False, False, False, True], vocab, seed=vocab + 5)
    expected = rejection_sample_reference(*args)
    result = _launch(device, rejection_sample_triton, rejection_sample, *args)
    assert torch.equal(result.tokens.cpu(), expected.tokens)
    assert torch.equal(result.num_accepted.cpu(), expected.num_accepted)


def _one_hot_q(tokens: list[int], k_top: int) -> CompressedProbs:
    """q' [len(tokens), k_top] with all mass on one token per row."""
    ids = torch.stack([torch.arange(k_top, dtype=torch.int32) + t for t in tokens])
    fixed = torch.zeros(len(tokens), k_top, dtype=torch.int32)
    fixed[:, 0] = 1 << 15
    return CompressedProbs(ids, fixed.to(torch.uint16))


@pytest.mark.parametrize("device", DEVICES)
def test_rejection_kernel_edge_cases(device):
    """Greedy ties across vocabulary blocks, drafts outside q', and residuals that are zero."""
    vocab, tie, k_top = 5000, 4096 + 7, 4
    p = torch.zeros(12, vocab)
    p[[0, 2], 7] = p[[0, 2], tie] = 0.5  # equal maxima in two blocks: the first wins
    p[[1, 3, 5, 7, 9, 11], 100] = 1.0
    p[4, 20] = p[6, 30] = p[8, 40] = p[10, 40] = 0.5  # p = q' / 2: the residual is zero
    requests = [
        ([7], True, [0]),  # greedy, accepted at the tie
        ([tie], True, [0]),  # greedy, rejected: the tie's first index is emitted
        ([21], False, [20]),  # q'(21) = 0: rejected, drawn from p
        ([30], False, [30]),  # accepted or rejected with u, then a fallback to p
        ([40], False, [40]),
        ([40], False, [40]),
    ]
    drafts = torch.tensor([d for r in requests for d in r[0]])
    q = _one_hot_q([t for r in requests for t in r[2]], k_top)
    greedy = torch.tensor([r[1] for r in requests])
    args = (VerifyBatch(p, drafts, torch.arange(1, 7), torch.arange(6) * 5 + 1, torch.arange(6)), q, greedy)
    expected = rejection_sample_reference(*args)
    assert expected.tokens[:2].tolist() == [[7, 100], [7, -1]]
    assert expected.tokens[2, 0] == 20 and expected.num_accepted[2] == 0
    result = _launch(device, rejection_sample_triton, rejection_sample, *args)
    assert torch.equal(result.tokens.cpu(), expected.tokens)
    assert torch.equal(result.num_accepted.cpu(), expected.num_accepted)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_verify_invariant_kernel(device, vocab):
    num_drafts, _ = _mixed(vocab)
    batch, _, _ = _batch(vocab, num_drafts, [False] * len(num_drafts), 4, seed=vocab)
    p, drafts, cu, seeds, positions = batch.target_probs, batch.draft_tokens, batch.cu_num_draft_tokens, batch.seeds, batch.positions
    # Make the first drafts of the 8-draft requests the target's own draws, so they are accepted.
    first = int(cu[1]) if len(num_drafts) > 2 else 0
    own = sample_reference(p[first + 2 : first + 6].contiguous(), seeds[2].repeat(4), positions[2] + torch.arange(4))
    drafts[first : first + 4] = own
    expected = verify_invariant_reference(batch)
    assert int(expected.num_accepted[2]) >= 4
    result = _launch(device, verify_invariant_triton, verify_invariant, batch)
    assert torch.equal(result.tokens.cpu(), expected.tokens)
    assert torch.equal(result.num_accepted.cpu(), expected.num_accepted)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1, 999, 4097, 49152])
def test_penalty_kernel(device, vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 6
    logits = 5 * torch.randn(rows, vocab, generator=gen)
    num = 700
    entries = penalty_entries(torch.randint(0, rows, (num,), generator=gen), torch.randint(0, vocab, (num,), generator=gen),
                              torch.rand(num, generator=gen) < 0.6, vocab)
    penalties = RowPenalties(torch.tensor([0.0, 0.5, -1.25, 2.0, 0.1, -2.0]),
                             torch.tensor([0.3, 0.0, 1.7, -0.6, 2.0, 0.05]),
                             torch.tensor([1.0, 1.3, 0.7, 2.0, 1.0001, 0.01]))
    expected = logits.clone()
    apply_penalties_reference(expected, entries, penalties, 1.0 / penalties.repetition)
    if device == "cpu":
        got = logits.clone()
        apply_penalties_triton(got, entries, penalties, 1.0 / penalties.repetition)
    else:
        got = logits.cuda()
        apply_penalties(got, type(entries)(*(t.cuda() for t in (entries.rows, entries.tokens, entries.counts))),
                        RowPenalties(*(t.cuda() for t in (penalties.presence, penalties.frequency, penalties.repetition))))
    assert torch.equal(got.cpu(), expected)
    assert not torch.equal(expected, logits)


def test_kernels_compile_for_sm90():
    """The compiler (not the interpreter) accepts every kernel: catches what only compilation checks."""
    script = textwrap.dedent(
        """
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from tandem_kernels import gumbel, penalties, rejection, sampling
        common = {"tokens_ptr": "*i64", "probs_ptr": "*fp32", "seeds_ptr": "*i64", "positions_ptr": "*i64",
                  "vocab": "i32"}
        ragged = {**common, "num_accepted_ptr": "*i32", "draft_ptr": "*i64", "cu_ptr": "*i64", "out_stride": "i32"}
        jobs = [
            (sampling._sample_kernel, {**common, "SALT": "constexpr", "BLOCK": "constexpr"},
             {"SALT": 1, "BLOCK": 1024}),
            (rejection._rejection_kernel, {**ragged, "q_ids_ptr": "*i32", "q_fixed_ptr": "*u16", "greedy_ptr": "*i1",
             "num_entries": "i32", "BLOCK": "constexpr", "BLOCK_K": "constexpr"}, {"BLOCK": 1024, "BLOCK_K": 16}),
            (gumbel._verify_invariant_kernel, {**ragged, "BLOCK": "constexpr"}, {"BLOCK": 1024}),
            (penalties._penalty_kernel, {"logits_ptr": "*fp32", "rows_ptr": "*i64", "tokens_ptr": "*i64",
             "counts_ptr": "*i32", "presence_ptr": "*fp32", "frequency_ptr": "*fp32", "repetition_ptr": "*fp32",
             "inverse_ptr": "*fp32", "num": "i32", "vocab": "i32", "BLOCK": "constexpr"}, {"BLOCK": 256}),
        ]
        for fn, signature, constexprs in jobs:
            names = list(fn.arg_names)
            ordered = {name: signature[name] for name in names}
            options = {"enable_fp_fusion": False} if fn is penalties._penalty_kernel else {}
            compiled = triton.compile(ASTSource(fn, ordered, constexprs), target=GPUTarget("cuda", 90, 32),
                                      options=options)
            assert "ptx" in compiled.asm, fn.__name__
            if options:  # the reference rounds each product: no fused multiply-add may stand for it
                assert "fma" not in compiled.asm["ptx"], fn.__name__
        print("compiled", len(jobs))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TANDEM_TRITON": "1"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = Path(__file__).parents[2]
    run = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compiled 4" in run.stdout
