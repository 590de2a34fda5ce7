"""A tiny random model for the model drafter's in-process tests, whose drafts depend on the whole prefix."""
from __future__ import annotations

import torch

from tandem.model.llama import LlamaModel, build_model
from tandem.model.random_weights import SHAPES, random_weights

CONFIG = SHAPES["tiny"]
VOCAB = CONFIG.vocab_size
MAX_LEN = 64


def tiny_draft_model(head_ids: torch.Tensor | None = None, num_slots: int = 4) -> LlamaModel:
    """head_ids: a reduced draft head of those vocabulary rows."""
    weights = random_weights(CONFIG, seed=11)
    # Random tied embeddings make the model repeat its last token whatever the context. A small
    # embedding and its own head make drafts depend on the whole prefix (so stale KV shows) and
    # give sampled rows several likely tokens.
    weights.embed = weights.embed * 0.2
    weights.lm_head = torch.randn(VOCAB, CONFIG.hidden_size, generator=torch.Generator().manual_seed(12)) * 0.5
    if head_ids is not None:
        weights.lm_head = weights.lm_head[head_ids]
    return build_model(CONFIG, weights, dtype=torch.float32, device=torch.device("cpu"),
                       num_slots=num_slots, max_model_len=MAX_LEN)
