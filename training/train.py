"""Distillation: KL(teacher || student) over the draft vocabulary, with held-out agreement and alpha."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from training.student import Student
from training.teacher import TeacherSequence


@dataclass(frozen=True, slots=True)
class TrainOptions:
    steps: int
    batch_size: int
    lr: float
    seed: int
    warmup_fraction: float = 0.1
    max_grad_norm: float = 1.0


@dataclass(frozen=True, slots=True)
class HeldOut:
    """Held-out figures on completion positions, the tokens a drafter proposes in serving."""

    greedy_agreement: float  # the student's argmax equals the teacher's full-vocabulary argmax
    alpha: float  # sum over tokens of min(p, q) at T=1: the acceptance rate of one sampled draft
    coverage: float  # the teacher's probability mass inside the draft vocabulary: alpha's ceiling
    positions: int


def draft_vocabulary(sequences: list[TeacherSequence], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent ids in the teacher's completions (ties to the lower id), ascending.

    When the completions hold fewer distinct ids, the rest are the lowest unused ids, so the
    head always has `size` rows.
    """
    if not 1 <= size <= vocab_size:
        raise ValueError(f"--draft-vocab must be in [1, {vocab_size}], got {size}")
    counts = Counter(t for s in sequences for t in s.token_ids[s.prompt_len :])
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    chosen = set(ranked)
    ranked += [t for t in range(vocab_size) if t not in chosen][: size - len(ranked)]
    return torch.tensor(sorted(ranked), dtype=torch.int64)


def split_held_out(sequences: list[TeacherSequence], fraction: float, seed: int
                   ) -> tuple[list[TeacherSequence], list[TeacherSequence]]:
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(seed)).tolist()
    num_held = max(1, round(fraction * len(sequences)))
    return [sequences[i] for i in order[num_held:]], [sequences[i] for i in order[:num_held]]


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor  # [B, T]
    teacher_hidden: torch.Tensor  # [B, T, hidden]
    completion: torch.Tensor  # [B, T] bool: positions that predict a completion token


def make_batch(sequences: list[TeacherSequence], device: torch.device) -> Batch:
    """Right-padded inputs token_ids[:-1] and the teacher states that predict token_ids[1:]."""
    length = max(len(s.token_ids) - 1 for s in sequences)
    hidden_size = sequences[0].hidden.shape[1]
    input_ids = torch.zeros(len(sequences), length, dtype=torch.int64)
    hidden = torch.zeros(len(sequences), length, hidden_size)
    completion = torch.zeros(len(sequences), length, dtype=torch.bool)
    for b, s in enumerate(sequences):
        n = len(s.token_ids) - 1
        input_ids[b, :n] = torch.tensor(s.token_ids[:-1])
        hidden[b, :n] = s.hidden.float()
        completion[b, s.prompt_len - 1 : n] = True
    return Batch(input_ids.to(device), hidden.to(device), completion.to(device))


def distill_loss(student: Student, batch: Batch) -> torch.Tensor:
    """Mean over completion positions of KL(p_N || q), p_N the teacher renormalized on the draft vocabulary.

    Completion positions are where a drafter drafts; the prompt positions still shape the
    layers' attention as context, and skipping their head rows saves a third of the step.
    """
    teacher_logp = F.log_softmax(batch.teacher_hidden[batch.completion] @ student.head.T, dim=-1)  # [P, N]
    student_hidden = student.hidden(batch.input_ids)[batch.completion]  # [P, hidden]
    student_logp = F.log_softmax(student_hidden @ student.head.T, dim=-1)  # [P, N]
    return F.kl_div(student_logp, teacher_logp, log_target=True, reduction="batchmean")


def train(student: Student, sequences: list[TeacherSequence], options: TrainOptions,
          on_step: Callable[[int, float], None] = lambda step, loss: None) -> None:
    """AdamW with a one-cycle schedule; batches drawn by a seeded generator, so runs repeat exactly."""
    device = student.embed.device
    student.train()
    optimize(student.trainable(), len(sequences), options,
             lambda step, picks: distill_loss(student, make_batch([sequences[i] for i in picks], device)), on_step)
    student.eval()


def optimize(params: list[torch.nn.Parameter], num_sequences: int, options: TrainOptions,
             batch_loss: Callable[[int, list[int]], torch.Tensor],
             on_step: Callable[[int, float], None]) -> None:
    """The loop both drafter kinds train with: each step draws batch_size sequence indices from a
    generator seeded with options.seed, takes batch_loss(step, picks), clips and steps AdamW under a
    one-cycle schedule. The same seed gives the same run."""
    torch.manual_seed(options.seed)
    generator = torch.Generator().manual_seed(options.seed)
    optimizer = torch.optim.AdamW(params, lr=options.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=options.lr, total_steps=options.steps,
                                                   pct_start=options.warmup_fraction)
    for step in range(options.steps):
        picks = torch.randint(num_sequences, (options.batch_size,), generator=generator).tolist()
        loss = batch_loss(step, picks)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, options.max_grad_norm)
        optimizer.step()
        schedule.step()
        on_step(step, loss.item())


@torch.no_grad()
def evaluate(student: Student, sequences: list[TeacherSequence], full_head: torch.Tensor,
             draft_vocab: torch.Tensor, subset: torch.Tensor | None = None, batch_size: int = 8) -> HeldOut:
    """Held-out figures; `subset` (indices into the draft vocabulary) measures a smaller head."""
    device = student.embed.device
    full_head = full_head.to(device)
    columns = torch.arange(len(draft_vocab), device=device) if subset is None else subset.to(device)
    ids = draft_vocab.to(device)[columns]  # [N'] target ids
    agree = alpha = coverage = 0.0
    positions = 0
    for first in range(0, len(sequences), batch_size):
        batch = make_batch(sequences[first : first + batch_size], device)
        hidden = student.hidden(batch.input_ids)[batch.completion]  # [P, hidden]
        q = F.softmax(hidden @ student.head[columns].T, dim=-1)  # [P, N']
        p = F.softmax(batch.teacher_hidden[batch.completion] @ full_head.T, dim=-1)  # [P, vocab]
        p_draft = p[:, ids]  # [P, N']
        agree += (ids[q.argmax(-1)] == p.argmax(-1)).sum().item()
        alpha += torch.minimum(p_draft, q).sum().item()
        coverage += p_draft.sum().item()
        positions += q.shape[0]
    positions = max(positions, 1)
    return HeldOut(agree / positions, alpha / positions, coverage / positions, positions)


def frequency_subset(draft_vocab: torch.Tensor, sequences: list[TeacherSequence], size: int) -> torch.Tensor:
    """Indices into draft_vocab of its `size` most frequent ids in the completions, for the N sweep."""
    ranked = draft_vocabulary(sequences, size, int(draft_vocab.max()) + 1)
    position = {int(t): i for i, t in enumerate(draft_vocab.tolist())}
    return torch.tensor([position[int(t)] for t in ranked if int(t) in position], dtype=torch.int64)

