"""Drafting with a small model: one batched forward per draft position, across all sequences.

A round per batch: a catch-up forward feeds each sequence's committed tokens that its KV slot
lacks (a whole prompt after Open, a few tokens after Extend) and gives the logits for d1; then
d1..d(k-1) are fed one position at a time. The slot keeps d1..d(k-1), so when the target commits
tokens equal to those drafts, the next catch-up starts after them: accepted drafts cost no
recompute. A rollback is a catch-up from an earlier position.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from draft_service.drafter import Draft, DraftJob, Sampling, SeqKey, make_draft
from draft_service.metrics import DraftMetrics
from kernels.compression import CompressedProbs, encode, sample_compressed
from kernels.sampling import processed_probs, sample
from tandem.model.batch import SequenceChunk
from tandem.model.llama import LlamaModel


@dataclass(slots=True)
class SlotState:
    slot: int
    cached: list[int]  # the tokens whose KV the slot holds at positions 0..len-1
    committed_len: int = 0  # base_len of the last round: what lies beyond it in `cached` are drafts


@dataclass(frozen=True, slots=True)
class DraftVocab:
    """A reduced draft head: its rows are the target ids `ids` [N] of a vocabulary of vocab_size."""

    ids: torch.Tensor  # [N] int64
    vocab_size: int


@dataclass(slots=True)
class DrawnTokens:
    tokens: list[int]  # [B]
    compressed: list[CompressedProbs | None]  # [B], q' [1, K] for rows that send probabilities


def common_prefix_len(a: list[int], b: list[int], likely: int = 0) -> int:
    """Length of the common prefix; `likely`, a length they probably share, is checked first at C speed."""
    n = min(len(a), len(b))
    i = likely if likely <= n and a[:likely] == b[:likely] else 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def stack_rows(rows: list[CompressedProbs]) -> CompressedProbs:
    """One CompressedProbs [N, K] from N single-row ones [1, K]."""
    return CompressedProbs(torch.cat([r.ids for r in rows]), torch.cat([r.fixed for r in rows]))


def draw_tokens(logits: torch.Tensor, samplings: list[Sampling], positions: list[int], probs_top_k: int,
                draft_vocab: DraftVocab | None = None) -> DrawnTokens:
    """One draft token per row of logits [B, N], row b being the token at sequence position positions[b].

    Logits cover the vocabulary, or the draft vocabulary of a drafter with a reduced head,
    whose q is zero elsewhere. Greedy rows take the argmax.
    Drafter-invariant rows draw from q with the noise the target shares (`sample`'s default
    TARGET_SALT). The others draw from q' = decode(encode(q)) with the drafter's own salt, and
    return q' for the wire.
    """
    tokens = logits.argmax(dim=1)  # [B]
    if draft_vocab is not None:
        tokens = draft_vocab.ids[tokens]
    compressed: list[CompressedProbs | None] = [None] * len(samplings)
    device = logits.device
    invariant = [b for b, s in enumerate(samplings) if not s.greedy and s.invariant]
    rejection = [b for b, s in enumerate(samplings) if s.sends_probs]
    if invariant or rejection:
        rows = invariant + rejection
        q = processed_probs(logits[rows], *_sampling_tensors([samplings[b] for b in rows], device))  # [S, N]
        if draft_vocab is not None:
            q = _scatter_to_vocabulary(q, draft_vocab)  # [S, V]
        seeds = torch.tensor([samplings[b].seed for b in rows], dtype=torch.int64, device=device)  # [S]
        pos = torch.tensor([positions[b] for b in rows], dtype=torch.int64, device=device)  # [S]
        drawn = torch.empty_like(seeds)  # [S]
        inv = slice(0, len(invariant))
        rej = slice(len(invariant), len(rows))
        if invariant:
            drawn[inv] = sample(q[inv], seeds[inv], pos[inv])
        if rejection:
            q_prime = encode(q[rej], probs_top_k)  # [R, K]
            drawn[rej] = sample_compressed(q_prime, seeds[rej], pos[rej])
            ids, fixed = q_prime.ids.cpu(), q_prime.fixed.cpu()
            for r, b in enumerate(rejection):
                compressed[b] = CompressedProbs(ids[r : r + 1], fixed[r : r + 1])
        tokens[rows] = drawn
    return DrawnTokens(tokens.tolist(), compressed)


def _scatter_to_vocabulary(q: torch.Tensor, draft_vocab: DraftVocab) -> torch.Tensor:
    """q [S, N] over the draft vocabulary as [S, V] over the whole vocabulary, zero outside it."""
    full = q.new_zeros(q.shape[0], draft_vocab.vocab_size)
    full[:, draft_vocab.ids] = q
    return full


def _sampling_tensors(samplings: list[Sampling], device: torch.device) -> tuple[torch.Tensor, ...]:
    """temperature, top_k, top_p, min_p [S] as processed_probs takes them."""
    return (
        torch.tensor([s.temperature for s in samplings], dtype=torch.float32, device=device),
        torch.tensor([s.top_k for s in samplings], dtype=torch.int64, device=device),
        torch.tensor([s.top_p for s in samplings], dtype=torch.float32, device=device),
        torch.tensor([s.min_p for s in samplings], dtype=torch.float32, device=device),
    )


class ModelDrafter:
    """Drafts with a LlamaModel, one KV slot per open sequence."""

    kind = "model"

    def __init__(self, model: LlamaModel, probs_top_k: int, metrics: DraftMetrics,
                 draft_vocab: torch.Tensor | None = None):
        self.model = model
        vocab_size = model.config.vocab_size
        self.draft_vocab = None if draft_vocab is None else DraftVocab(draft_vocab, vocab_size)
        head_rows = vocab_size if draft_vocab is None else len(draft_vocab)
        self.probs_top_k = min(probs_top_k, head_rows)  # encode's K, which Info reports
        self.metrics = metrics
        self._states: dict[SeqKey, SlotState] = {}

    def open(self, key: SeqKey) -> None:
        self._states[key] = SlotState(self.model.kv_cache.allocate(), [])

    def close(self, key: SeqKey) -> None:
        self.model.kv_cache.free(self._states.pop(key).slot)

    def budget(self, job: DraftJob) -> int:
        """Draft tokens for this job: k, fewer when the slot would overflow (its KV ends at base_len + k - 2)."""
        return min(job.sequence.k, self.model.max_len + 1 - job.base_len)

    @torch.inference_mode()
    def draft(self, jobs: list[DraftJob]) -> list[Draft]:
        jobs = [j for j in jobs if self.budget(j) > 0 and not j.sequence.closed]
        if not jobs:
            return []
        budgets = [self.budget(j) for j in jobs]
        drafted: list[list[int]] = [[] for _ in jobs]
        rows: list[list[CompressedProbs]] = [[] for _ in jobs]
        logits = self._catch_up(jobs)  # [B, V]
        active = list(range(len(jobs)))
        for step in range(max(budgets)):
            drawn = draw_tokens(logits, [jobs[i].sequence.sampling for i in active],
                                [jobs[i].base_len + step for i in active], self.probs_top_k, self.draft_vocab)
            for i, token, row in zip(active, drawn.tokens, drawn.compressed):
                drafted[i].append(token)
                if row is not None:
                    rows[i].append(row)
            active = [i for i in active if step + 1 < budgets[i] and not jobs[i].sequence.closed]
            if not active:
                break
            logits = self._feed([(jobs[i], drafted[i][-1]) for i in active])  # [len(active), V]
        return [
            make_draft(job, ids, stack_rows(row) if row else None)
            for job, ids, row in zip(jobs, drafted, rows)
            if not job.sequence.closed
        ]

    def _catch_up(self, jobs: list[DraftJob]) -> torch.Tensor:
        """Feed each job's committed tokens that its slot lacks; logits [B, V] at each last position."""
        chunks = []
        prefills = False
        for job in jobs:
            state = self._states[job.sequence.key]
            # At least the last committed token is fed again: its logits give d1.
            reuse = common_prefix_len(state.cached, job.tokens, likely=state.committed_len)
            start = min(reuse, job.base_len - 1)
            self.metrics.reused_tokens.inc(max(0, start - state.committed_len))
            prefills |= state.committed_len == 0
            state.cached = job.tokens[:start]  # until the forward has written the rest
            chunks.append(SequenceChunk(state.slot, start, job.tokens[start:]))
        began = time.perf_counter()
        logits = self.model.run(chunks)
        if prefills:
            self.metrics.prefill_duration.observe(time.perf_counter() - began)
        for job in jobs:
            state = self._states[job.sequence.key]
            state.cached = list(job.tokens)
            state.committed_len = job.base_len
        return logits

    def _feed(self, pending: list[tuple[DraftJob, int]]) -> torch.Tensor:
        """Write one draft token per job into its slot; logits [B, V] for the next draft."""
        chunks = []
        for job, token in pending:
            state = self._states[job.sequence.key]
            chunks.append(SequenceChunk(state.slot, len(state.cached), [token]))
        logits = self.model.run(chunks)
        for job, token in pending:
            self._states[job.sequence.key].cached.append(token)
        return logits
