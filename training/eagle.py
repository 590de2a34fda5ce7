"""Training an EAGLE-3 head: teacher features, the trainable head, and training-time test.

Teacher features come from one capturing forward per teacher sequence (tandem.model.llama's
forward_capturing): the residual stream entering each chosen target layer at every position,
the same rows the target sends a drafter in serving.

Training-time test (EAGLE-3) unrolls the head on its own predictions: step 0 reads the target's
feature of position p - 1; step j reads the head's step j - 1 output at p - 1, and its attention
sees what a draft at depth j sees in serving: the step-0 rows up to p - j (the committed tokens)
and the step-i rows at p - j + i for i = 1..j (the drafts before it). Every step's logits are
trained towards the teacher's at the same position, with weight decay^j.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from training.teacher import TeacherSequence
from training.train import TrainOptions, optimize
from tandem.config import ModelConfig
from tandem.model.batch import SequenceChunk
from tandem.model.eagle3 import Eagle3Config, Eagle3Weights
from tandem.model.llama import LayerWeights, LlamaModel
from tandem.model.rope import RotaryEmbedding

STEP_DECAY = 0.8  # EAGLE-3's weight of the loss at unrolled step j: 0.8 ** j


@torch.inference_mode()
def teacher_features(model: LlamaModel, sequences: list[TeacherSequence], layers: tuple[int, ...],
                     progress: Callable[[int], None] = lambda n: None) -> list[torch.Tensor]:
    """Per sequence, bf16 [len - 1, len(layers), hidden]: row p is the feature of position p."""
    features = []
    for s in sequences:
        chunk = SequenceChunk(0, 0, s.token_ids[:-1])
        _, captured = model.forward_capturing(model.build_batch([chunk]), layers)
        features.append(captured.to(torch.bfloat16))
        progress(1)
    return features


@dataclass(slots=True)
class EagleBatch:
    input_ids: torch.Tensor  # [B, T]: token_ids[:-1]
    features: torch.Tensor  # [B, T, layers * target_hidden]: row p the target's feature of position p
    teacher_hidden: torch.Tensor  # [B, T, hidden]: the teacher's normed state predicting token p + 1
    completion: torch.Tensor  # [B, T] bool: rows that predict a completion token


def make_eagle_batch(sequences: list[TeacherSequence], features: list[torch.Tensor],
                     device: torch.device) -> EagleBatch:
    length = max(len(s.token_ids) - 1 for s in sequences)
    width = features[0].shape[1] * features[0].shape[2]
    input_ids = torch.zeros(len(sequences), length, dtype=torch.int64)
    feats = torch.zeros(len(sequences), length, width)
    hidden = torch.zeros(len(sequences), length, sequences[0].hidden.shape[1])
    completion = torch.zeros(len(sequences), length, dtype=torch.bool)
    for b, (s, f) in enumerate(zip(sequences, features)):
        n = len(s.token_ids) - 1
        input_ids[b, :n] = torch.tensor(s.token_ids[:-1])
        feats[b, :n] = f.reshape(n, width).float()
        hidden[b, :n] = s.hidden.float()
        completion[b, s.prompt_len - 1 : n] = True
    return EagleBatch(input_ids.to(device), feats.to(device), hidden.to(device), completion.to(device))


class EagleStudent(nn.Module):
    """The head as nn.Parameters: fc, one layer over [normed embedding, normed feature], a final norm.

    The embedding and the draft head (the target's lm_head rows of the draft vocabulary) are frozen.
    """

    def __init__(self, config: ModelConfig, layer: LayerWeights, norm: torch.Tensor, embed: torch.Tensor,
                 head: torch.Tensor, draft_ids: torch.Tensor, feature_layers: tuple[int, ...],
                 inv_freq: torch.Tensor, max_len: int, device: torch.device, seed: int):
        super().__init__()
        h = config.hidden_size
        self.config = config
        self.feature_layers = feature_layers
        g = torch.Generator().manual_seed(seed)
        fc = torch.zeros(h, len(feature_layers) * h)
        fc[:, -h:] = torch.eye(h)  # starts from the highest layer's feature as it is
        self.fc = nn.Parameter(fc)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(layer.attn_norm.detach().clone().float())
        # The attention reads the feature as the target layer it comes from does; the embedding half
        # starts small, so that training decides what the token adds.
        token_half = torch.randn(layer.qkv.shape[0], h, generator=g) * 0.02
        self.qkv = nn.Parameter(torch.cat([token_half, layer.qkv.detach().float()], dim=1))
        for name in ("o", "gate_up", "down"):
            setattr(self, name, nn.Parameter(getattr(layer, name).detach().clone().float()))
        self.post_norm = nn.Parameter(layer.mlp_norm.detach().clone().float())
        self.norm = nn.Parameter(norm.detach().clone().float())
        self.register_buffer("embed", embed.float(), persistent=False)  # [vocab, hidden], frozen
        self.register_buffer("head", head.float(), persistent=False)  # [N, hidden], frozen
        self.register_buffer("draft_ids", draft_ids.clone(), persistent=False)
        self.to(device)
        self.rope = RotaryEmbedding(inv_freq, max_len, torch.float32, device)

    def unrolled(self, batch: EagleBatch, steps: int) -> list[torch.Tensor]:
        """Normed output states [B, T, hidden] of unrolled steps 0..steps-1 (training-time test)."""
        embedded = self._rms(F.embedding(batch.input_ids, self.embed), self.input_norm)  # [B, T, h]
        fused = F.linear(batch.features, self.fc)  # [B, T, h]: row p the fused feature of position p
        feature = F.pad(fused[:, :-1], (0, 0, 1, 0))  # row p reads position p - 1's; zeros at p = 0
        positions = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outputs = []
        for step in range(steps):
            x = torch.cat([embedded, self._rms(feature, self.hidden_norm)], dim=-1)
            q, k, v = self._qkv(x, positions)  # [B, heads or kv_heads, T, head_dim]
            keys.append(k)
            values.append(v)
            attn = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                                  attn_mask=unrolled_mask(len(positions), step, q.device))
            b, _, t, _ = q.shape
            hidden = feature + F.linear(attn.transpose(1, 2).reshape(b, t, -1), self.o)
            gate, up = F.linear(self._rms(hidden, self.post_norm), self.gate_up).chunk(2, dim=-1)
            hidden = hidden + F.linear(F.silu(gate) * up, self.down)  # [B, T, h]
            outputs.append(self._rms(hidden, self.norm))
            feature = F.pad(hidden[:, :-1], (0, 0, 1, 0))  # the next step reads this step's at p - 1
        return outputs

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg = self.config
        b, t, _ = x.shape
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = F.linear(x, self.qkv)
        qk = self.rope.apply(qkv[..., : q_size + kv_size].reshape(b * t, -1, cfg.head_dim),
                             positions.repeat(b)).view(b, t, -1, cfg.head_dim)
        q = qk[:, :, : cfg.num_heads].transpose(1, 2)
        k = qk[:, :, cfg.num_heads :].transpose(1, 2).repeat_interleave(cfg.queries_per_kv, dim=1)
        v = qkv[..., q_size + kv_size :].view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        return q, k, v.repeat_interleave(cfg.queries_per_kv, dim=1)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.config.rms_norm_eps)

    def export(self, target_hidden: int) -> tuple[Eagle3Config, Eagle3Weights]:
        """The head as the serving model (and save_eagle3) takes it."""
        def value(p: torch.Tensor) -> torch.Tensor:
            return p.detach().float().cpu().clone()

        config = Eagle3Config(dataclasses.replace(self.config, num_layers=1), target_hidden, self.feature_layers, len(self.draft_ids))
        weights = Eagle3Weights(fc=value(self.fc), embed=value(self.embed), input_norm=value(self.input_norm),
                                hidden_norm=value(self.hidden_norm), qkv=value(self.qkv), o=value(self.o),
                                post_norm=value(self.post_norm), gate_up=value(self.gate_up),
                                down=value(self.down), norm=value(self.norm), lm_head=value(self.head),
                                draft_ids=self.draft_ids.cpu().clone())
        return config, weights


def unrolled_mask(length: int, step: int, device: torch.device) -> torch.Tensor:
    """[T, (step + 1) * T] bool: a query at p of unrolled step `step` sees the step-0 keys up to
    p - step and the step-i key at p - step + i (i = 1..step), as a draft at that depth does."""
    p = torch.arange(length, device=device)
    blocks = [p[None, :] <= (p[:, None] - step)]
    blocks += [p[None, :] == (p[:, None] - step + i) for i in range(1, step + 1)]
    return torch.cat(blocks, dim=1)  # the block of the step itself always shows the query its own key


def eagle_loss(student: EagleStudent, batch: EagleBatch, steps: int) -> torch.Tensor:
    """sum_j decay^j * KL(p_N || q_j) over completion rows, p_N the teacher on the draft vocabulary."""
    rows = batch.completion
    teacher_logp = F.log_softmax(batch.teacher_hidden[rows] @ student.head.T, dim=-1)  # [P, N]
    total = 0.0
    for step, hidden in enumerate(student.unrolled(batch, steps)):
        student_logp = F.log_softmax(hidden[rows] @ student.head.T, dim=-1)
        total = total + STEP_DECAY**step * F.kl_div(student_logp, teacher_logp, log_target=True,
                                                     reduction="batchmean")
    return total


def train_eagle(student: EagleStudent, sequences: list[TeacherSequence], features: list[torch.Tensor],
                options: TrainOptions, steps_for: Callable[[int], int],
                on_step: Callable[[int, float], None] = lambda step, loss: None) -> None:
    """train.optimize over the head's parameters; steps_for(step) is how far that step unrolls."""
    device = student.embed.device

    def batch_loss(step: int, picks: list[int]) -> torch.Tensor:
        batch = make_eagle_batch([sequences[i] for i in picks], [features[i] for i in picks], device)
        return eagle_loss(student, batch, steps_for(step))

    student.train()
    optimize([p for p in student.parameters() if p.requires_grad], len(sequences), options, batch_loss, on_step)
    student.eval()


@dataclass(frozen=True, slots=True)
class EagleHeldOut:
    """Held-out agreement with the teacher's full-vocabulary argmax at each draft depth."""

    depth_agreement: tuple[float, ...]  # depth j: draft j + 1 right, given drafts 1..j were right
    positions: int

    @property
    def mean_accepted_length(self) -> float:
        """Greedy, k = len(depth_agreement): 1 + sum_j prod_{i <= j} a_i (the bonus token counted)."""
        total, reach = 1.0, 1.0
        for a in self.depth_agreement:
            reach *= a
            total += reach
        return total


@torch.no_grad()
def evaluate_eagle(student: EagleStudent, sequences: list[TeacherSequence], features: list[torch.Tensor],
                   full_head: torch.Tensor, depths: int = 4, batch_size: int = 8) -> EagleHeldOut:
    device = student.embed.device
    full_head = full_head.to(device)
    right = [0.0] * depths
    positions = 0
    for first in range(0, len(sequences), batch_size):
        batch = make_eagle_batch(sequences[first : first + batch_size], features[first : first + batch_size],
                                 device)
        truth = (batch.teacher_hidden[batch.completion] @ full_head.T).argmax(-1)  # [P]
        for depth, hidden in enumerate(student.unrolled(batch, depths)):
            guess = student.draft_ids[(hidden[batch.completion] @ student.head.T).argmax(-1)]
            right[depth] += (guess == truth).sum().item()
        positions += int(batch.completion.sum())
    positions = max(positions, 1)
    return EagleHeldOut(tuple(r / positions for r in right), positions)
