"""A plain, readable generation loop: the reference that the serving paths are tested against."""
from __future__ import annotations

import torch

from tandem.model.batch import SequenceChunk
from tandem.model.llama import LlamaModel


@torch.inference_mode()
def greedy_generate(
    model: LlamaModel,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    slot: int = 0,
    stop_token_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """Greedy decoding of one sequence in one KV slot; stops after a stop token or the budget."""
    logits = model.run([SequenceChunk(slot=slot, start=0, token_ids=list(prompt_ids))])
    generated: list[int] = []
    while True:
        token = int(logits[-1].argmax())
        generated.append(token)
        if token in stop_token_ids or len(generated) >= max_new_tokens:
            return generated
        start = len(prompt_ids) + len(generated) - 1
        logits = model.run([SequenceChunk(slot=slot, start=start, token_ids=[token])])
