"""Teacher data with our own runtime: seeded, batched sampling, then the teacher's last hidden states.

A sequence's randomness is keyed by (its seed, position), as in serving, so the data does not
depend on batch size or order, and a cache can grow by the sequences it lacks. The hidden states
(after the final norm), kept from the same forwards, are what the teacher's lm_head reads: with
the head rows, training recovers the teacher's logits over any draft vocabulary without storing
[tokens, vocab] logits.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem_kernels.sampling import processed_probs, sample
from tandem.model.batch import SequenceChunk
from tandem.model.llama import LlamaModel
from tandem.tokenizer import Tokenizer


@dataclass(slots=True)
class TeacherSequence:
    token_ids: list[int]  # prompt then completion
    prompt_len: int
    hidden: torch.Tensor  # [len(token_ids) - 1, hidden] bf16: row t is the normed state that predicts token t + 1


Progress = Callable[[int], None]
EntryKey = tuple[int, int]  # (sample, prompt index): the sample-th completion of that prompt


def encode_prompts(tokenizer: Tokenizer, prompts: list[str]) -> list[list[int]]:
    """Each prompt as a user turn of the chat template; plain text for a model that has none."""
    if tokenizer.chat_template is None:
        return [tokenizer.encode(p) for p in prompts]
    return [tokenizer.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]


@torch.inference_mode()
def generate_completions(model: LlamaModel, prompts: list[list[int]], *, seeds: list[int], max_new_tokens: int,
                         temperature: float, stop_ids: frozenset[int],
                         progress: Progress = lambda n: None) -> list[TeacherSequence]:
    """Samples each prompt's completion with its own seed, up to model.kv_cache's slot count at a time."""
    batch_size = model.kv_cache.num_slots
    sequences = []
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        sequences += _generate_batch(model, batch, seeds[first : first + batch_size], max_new_tokens, temperature,
                                     stop_ids)
        progress(len(batch))
    return sequences


def _generate_batch(model: LlamaModel, prompts: list[list[int]], seeds: list[int], max_new_tokens: int,
                    temperature: float, stop_ids: frozenset[int]) -> list[TeacherSequence]:
    tokens = [list(p) for p in prompts]
    hidden: list[list[torch.Tensor]] = [[] for _ in prompts]
    chunks = [SequenceChunk(slot, 0, list(p), num_logits=len(p)) for slot, p in enumerate(prompts)]
    live = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        states = model.final_hidden(model.build_batch(chunks))  # [sum of num_logits, hidden]
        ends = torch.tensor([c.num_logits for c in chunks]).cumsum(0) - 1  # each chunk's last row
        drawn = _draw(model.logits(states[ends]), [seeds[i] for i in live], [len(tokens[i]) for i in live],
                      temperature)
        for i, rows, token in zip(live, states.split([c.num_logits for c in chunks]), drawn):
            hidden[i].append(rows.to(device="cpu", dtype=torch.bfloat16))
            tokens[i].append(token)
        live = [i for i, token in zip(live, drawn) if token not in stop_ids]
        chunks = [SequenceChunk(i, len(tokens[i]) - 1, [tokens[i][-1]]) for i in live]
        if not live:
            break
    return [TeacherSequence(t, len(p), torch.cat(h)) for t, p, h in zip(tokens, prompts, hidden)]


def _draw(logits: torch.Tensor, seeds: list[int], positions: list[int], temperature: float) -> list[int]:
    rows = logits.shape[0]
    probs = processed_probs(
        logits,
        torch.full((rows,), temperature, dtype=torch.float32),
        torch.zeros(rows, dtype=torch.int64),
        torch.ones(rows, dtype=torch.float32),
        torch.zeros(rows, dtype=torch.float32),
    )  # [B, vocab]
    return sample(probs, torch.tensor(seeds), torch.tensor(positions)).tolist()


def save_teacher_data(path: Path, entries: dict[EntryKey, TeacherSequence], key: dict[str, Any]) -> None:
    """The sequences and their hidden states in one file, with the `key` (flags, target) they came from."""
    order = sorted(entries)
    torch.save({"key": key, "entries": order, "token_ids": [entries[e].token_ids for e in order],
                "prompt_lens": [entries[e].prompt_len for e in order],
                "hidden": torch.cat([entries[e].hidden for e in order])}, path)


def load_teacher_data(path: Path, key: dict[str, Any]) -> dict[EntryKey, TeacherSequence]:
    """Sequences saved by save_teacher_data; ValueError when they came from other flags or another target."""
    data = torch.load(path, weights_only=True)
    if data["key"] != key:
        differ = sorted(k for k in key.keys() | data["key"].keys() if key.get(k) != data["key"].get(k))
        raise ValueError(f"the teacher data in {path} was made with other {', '.join(differ)}: "
                         "delete it, or give another --teacher-data path")
    rows = [len(t) - 1 for t in data["token_ids"]]
    return {tuple(e): TeacherSequence(t, p, h) for e, t, p, h in zip(data["entries"], data["token_ids"],
                                                                     data["prompt_lens"], data["hidden"].split(rows))}
