"""Sampling: the target's processed distribution p, and keyed draws from it.

`processed_probs` turns logits into p (temperature, then top-k, top-p and min-p), one set of
parameters per row. Greedy rows (temperature 0, or below GREEDY_BELOW_TEMPERATURE) get the one-hot
of the first argmax, so every later step treats greedy and random rows alike: a draw from a
one-hot p is its argmax.

`sample` draws by an exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) keyed by
(seed, position, salt), which is a draw from p (the Gumbel-max trick, since
log p_i - log E_i = log p_i + Gumbel). The draw depends on its key alone, whatever the batch.
Ties go to the lowest index everywhere, as torch.argmax does.

p is built with sort-based torch ops on any device (as vLLM does); only the draw is a kernel.

`Sampling` is a sequence's parameters, the one form both services carry from the request to
these kernels: it says what greedy is, when verification needs the drafter's q', and which values
are in range. It also holds the request's logits rules (penalties, logit_bias, allowed tokens,
bad words), which logits_processors.py applies to the logits before p is built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem_kernels._triton import INTERPRETED, jit, next_power_of_2, require_triton, tl
from tandem_kernels.checks import KernelInputError, check_tensor
from tandem_kernels.random import TARGET_SALT, race_weights, tl_race_weights

# A GPU pays for a block in registers, Triton's CPU interpreter per loop iteration.
BLOCK_V = 4096 if INTERPRETED else 1024
# Temperatures below this sample greedily, as in vLLM: logits / T overflows float32 long before T
# reaches 0, and a softmax of infinities is NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # presence and frequency in [-2, 2], repetition in (0, 2], as in vLLM and OpenAI
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True, slots=True)
class SamplingProblem:
    """A parameter out of range: the field to fix, and why."""

    field: str
    message: str


@dataclass(frozen=True, slots=True)
class Sampling:
    """How one sequence's tokens are drawn; the drafter drafts with the target's own."""

    temperature: float = 0.0  # below GREEDY_BELOW_TEMPERATURE: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0  # non-negative int64, as the draws are keyed
    drafter_invariant: bool = False  # the drafter draws with the target's shared noise
    # Rules on the logits before p (tandem_kernels/logits_processors.py), vLLM's definitions.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids distinct
    allowed_token_ids: tuple[int, ...] = ()  # empty: every token
    bad_words: tuple[tuple[int, ...], ...] = ()  # token ids of each word, as the target tokenized it

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def needs_draft_probs(self) -> bool:
        """Rejection sampling needs q'; greedy and drafter-invariant verification need ids only."""
        return not self.greedy and not self.drafter_invariant

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Some rule changes the logits before p: a penalty, a bias, an allow list or bad words."""
        return self.penalized or bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    @property
    def reads_history(self) -> bool:
        """Its logits rules read the tokens before each position: penalties and bad words."""
        return self.penalized or bool(self.bad_words)

    def problem(self, vocab_size: int | None = None) -> SamplingProblem | None:
        """The first parameter the kernels would refuse, or None; vocab_size: also check token ids."""
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            return SamplingProblem("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.top_k < 0:
            return SamplingProblem("top_k", f"must be >= 0 (0: off), got {self.top_k}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            return SamplingProblem("top_p", f"must be in (0, 1], got {self.top_p}")
        if not math.isfinite(self.min_p) or not 0 <= self.min_p <= 1:
            return SamplingProblem("min_p", f"must be in [0, 1], got {self.min_p}")
        return self._rules_problem(vocab_size)

    def _rules_problem(self, vocab_size: int | None) -> SamplingProblem | None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                return SamplingProblem(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not math.isfinite(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_PENALTY:
            return SamplingProblem("repetition_penalty", f"must be in (0, {MAX_PENALTY:g}], got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if not math.isfinite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                return SamplingProblem("logit_bias", f"the bias of token {token} must be in "
                                                     f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            return SamplingProblem("logit_bias", "names a token twice")
        if any(not word for word in self.bad_words):
            return SamplingProblem("bad_words", "a word has no tokens")
        ids = {"logit_bias": [t for t, _ in self.logit_bias], "allowed_token_ids": self.allowed_token_ids,
               "bad_words": [t for word in self.bad_words for t in word]}
        for name, tokens in ids.items():
            outside = [t for t in tokens if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if outside:
                return SamplingProblem(name, f"token id {outside[0]} is outside the vocabulary"
                                             + (f" of {vocab_size}" if vocab_size is not None else ""))
        return None


def probs_of(logits: torch.Tensor, samplings: list[Sampling]) -> torch.Tensor:
    """processed_probs [B, V] for logits [B, V], row b under samplings[b]."""
    f32 = dict(dtype=torch.float32, device=logits.device)
    return processed_probs(
        logits,
        torch.tensor([s.temperature for s in samplings], **f32),
        torch.tensor([s.top_k for s in samplings], dtype=torch.int64, device=logits.device),
        torch.tensor([s.top_p for s in samplings], **f32),
        torch.tensor([s.min_p for s in samplings], **f32),
    )


def processed_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """p [B, V] float32 from logits [B, V]; per row temperature, top_k (<= 0: off), top_p, min_p."""
    _check_sampling_params(logits, temperature, top_k, top_p, min_p)
    logits = logits.float()
    greedy = temperature < GREEDY_BELOW_TEMPERATURE  # [B]
    one_hot = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=1, keepdim=True), 1.0)
    if bool(greedy.all()):  # the common serving case: no softmax over the vocabulary at all
        return one_hot
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / scale[:, None], dim=-1)  # [B, V]
    # Only the rows that ask: filtering renormalizes and drops a float32 tail, so a row that asks
    # for nothing must not depend on what it is batched with.
    filtered = ((top_k > 0) | (top_p < 1) | (min_p > 0)).nonzero().squeeze(1)  # [F]
    if filtered.numel():
        probs[filtered] = _filter(probs[filtered], top_k[filtered], top_p[filtered], min_p[filtered])
    return torch.where(greedy[:, None], one_hot, probs)


def _filter(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Keep the top-k, then the top-p nucleus of that, then entries >= min_p * max; renormalize."""
    vocab = probs.shape[1]
    # A stable sort breaks ties by index, so the kept set is deterministic.
    sorted_probs, order = probs.sort(dim=1, descending=True, stable=True)  # [B, V]
    rank = torch.arange(vocab, device=probs.device)
    keep = rank[None, :] < torch.where(top_k > 0, top_k, vocab).to(probs.device)[:, None]
    kept = sorted_probs * keep
    # top-p applies to the top-k distribution renormalized, as in HF transformers.
    mass_before = (kept.cumsum(dim=1) - kept) / kept.sum(dim=1, keepdim=True)
    keep &= mass_before < top_p[:, None]
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    filtered = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
    return filtered / filtered.sum(dim=1, keepdim=True)


def _check_sampling_params(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> None:
    """Shapes, dtypes and ranges of processed_probs' arguments."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise KernelInputError(f"logits: expected a float [B, V] tensor, got {logits.dtype} {list(logits.shape)}")
    batch, device = logits.shape[0], logits.device
    check_tensor("temperature", temperature, torch.float32, (batch,), device)
    check_tensor("top_k", top_k, torch.int64, (batch,), device)
    check_tensor("top_p", top_p, torch.float32, (batch,), device)
    check_tensor("min_p", min_p, torch.float32, (batch,), device)
    if not bool(((temperature >= 0) & temperature.isfinite()).all()):
        raise KernelInputError("temperature: must be finite and >= 0")
    if not bool(((top_p > 0) & (top_p <= 1)).all()):
        raise KernelInputError("top_p: must be in (0, 1]")
    if not bool(((min_p >= 0) & (min_p <= 1)).all()):
        raise KernelInputError("min_p: must be in [0, 1]")


def sample(
    probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salt: int = TARGET_SALT
) -> torch.Tensor:
    """Tokens [B] int64 drawn from probs [B, V] keyed by (seeds[b], positions[b], salt)."""
    _check_sample(probs, seeds, positions)
    if probs.is_cuda:
        return sample_triton(probs, seeds, positions, salt)
    return sample_reference(probs, seeds, positions, salt)


def _check_sample(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> None:
    """probs float32 [B, V] with V >= 1; seeds and positions int64 [B] on the same device."""
    check_tensor("probs", probs, torch.float32, (None, None), probs.device)
    if probs.shape[1] == 0:
        raise KernelInputError("probs: the vocabulary is empty")
    check_tensor("seeds", seeds, torch.int64, (probs.shape[0],), probs.device)
    check_tensor("positions", positions, torch.int64, (probs.shape[0],), probs.device)


def sample_reference(
    probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salt: int = TARGET_SALT
) -> torch.Tensor:
    """PyTorch reference of `sample`."""
    index = torch.arange(probs.shape[1], device=probs.device)
    return (probs * race_weights(seeds, positions, salt, index)).argmax(dim=1)


def sample_triton(
    probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salt: int = TARGET_SALT
) -> torch.Tensor:
    """Launch `_sample_kernel`, one program per row."""
    require_triton()
    batch, vocab = probs.shape
    tokens = torch.empty(batch, dtype=torch.int64, device=probs.device)
    block = min(BLOCK_V, next_power_of_2(vocab))
    _sample_kernel[(batch,)](tokens, probs, seeds, positions, vocab, SALT=salt, BLOCK=block)
    return tokens


@jit(do_not_specialize=["vocab"])
def _sample_kernel(tokens_ptr, probs_ptr, seeds_ptr, positions_ptr, vocab, SALT: tl.constexpr, BLOCK: tl.constexpr):
    """tokens[b] = argmax(probs[b] * race weights keyed by (seed, position))."""
    b = tl.program_id(0)
    seed = tl.load(seeds_ptr + b)
    position = tl.load(positions_ptr + b)
    row_ptr = probs_ptr + b.to(tl.int64) * vocab
    tl.store(tokens_ptr + b, tl_race_argmax(row_ptr, vocab, seed, position, SALT, BLOCK).to(tl.int64))


@jit()
def tl_race_argmax(row_ptr, vocab, seed, position, SALT: tl.constexpr, BLOCK: tl.constexpr):
    """argmax(p * race weights) over one row, first index on ties (torch.argmax's rule)."""
    best_key = tl.full((), -1.0, tl.float32)
    best_index = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        p = tl.load(row_ptr + offs, mask=inside, other=0.0)
        key = tl.where(inside, p * tl_race_weights(seed, position, SALT, offs.to(tl.uint32)), -1.0)
        block_key, block_index = tl.max(key, 0, return_indices=True, return_indices_tie_break_left=True)
        better = block_key > best_key
        best_index = tl.where(better, start + block_index, best_index)
        best_key = tl.where(better, block_key, best_key)
    return best_index


@jit()
def tl_argmax(row_ptr, vocab, BLOCK: tl.constexpr):
    """argmax over one row, first index on ties."""
    best_value = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        values = tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf"))
        block_value, block_index = tl.max(values, 0, return_indices=True, return_indices_tie_break_left=True)
        better = block_value > best_value
        best_index = tl.where(better, start + block_index, best_index)
        best_value = tl.where(better, block_value, best_value)
    return best_index
