"""What a request asks of its logits before p is built, in vLLM's order, per position.

For each row, on both services (the target's verify rows and the drafter's draft rows alike):
1. `allowed_token_ids`: every other token gets -inf;
2. `bad_words`: a word's last token gets -inf where the generated tokens before the row end with
   the rest of the word (a one-token word always);
3. the min_tokens ban: EOS and the stop tokens get -inf on the rows it covers;
4. `logit_bias` is added;
5. the penalties (tandem_kernels/penalties.py), counting the tokens before the row.

A verify row i follows the committed tokens and the drafts d1..di, so p at each row is the
distribution the target alone would sample from after those tokens, and rejection sampling
stays exact.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tandem_kernels.penalties import RowPenalties, apply_penalties, penalty_entries
from tandem_kernels.sampling import Sampling


@dataclass(frozen=True, slots=True)
class LogitsContext:
    """The tokens an item's logits rows follow: row i follows `tokens` and then drafts[:i]."""

    tokens: Sequence[int]  # committed tokens, prompt first (empty when no rule reads them)
    prompt_len: int
    drafts: Sequence[int] = ()
    banned: tuple[int, ...] = ()  # min_tokens: EOS and the stop tokens
    banned_rows: int = 0  # the first rows the ban covers

    @property
    def num_rows(self) -> int:
        return len(self.drafts) + 1

    def recent_generated(self, row: int, count: int) -> list[int]:
        """The last `count` generated tokens before row `row` (fewer when fewer were generated)."""
        if count <= 0:
            return []
        committed = list(self.tokens[max(self.prompt_len, len(self.tokens) - count):])
        return (committed + list(self.drafts[:row]))[-count:]


def process_logits(logits: torch.Tensor, items: list[tuple[int, Sampling, LogitsContext]]) -> None:
    """In place on logits [rows, V]: each item (first row, sampling, context) owns context.num_rows rows."""
    for first, sampling, context in items:
        _apply_rules(logits[first : first + context.num_rows], sampling, context)
    penalized = [item for item in items if item[1].penalized]
    if penalized:
        _penalize(logits, penalized)


def _apply_rules(logits: torch.Tensor, sampling: Sampling, context: LogitsContext) -> None:
    """Steps 1 to 4 on one item's rows [rows, V]."""
    if sampling.allowed_token_ids:
        keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
        keep[list(sampling.allowed_token_ids)] = True
        logits.masked_fill_(~keep, float("-inf"))
    for row in range(logits.shape[0] if sampling.bad_words else 0):
        if banned := _bad_word_ends(sampling.bad_words, context, row):
            logits[row, banned] = float("-inf")
    if context.banned and context.banned_rows > 0:
        logits[: context.banned_rows, list(context.banned)] = float("-inf")
    if sampling.logit_bias:
        ids, biases = zip(*sampling.logit_bias)
        logits[:, list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)


def _bad_word_ends(bad_words: tuple[tuple[int, ...], ...], context: LogitsContext, row: int) -> list[int]:
    """The last tokens of the bad words whose other tokens the generated ones before `row` end with."""
    tail = context.recent_generated(row, max(len(w) for w in bad_words) - 1)
    return [w[-1] for w in bad_words if len(w) == 1 or tail[1 - len(w):] == list(w[:-1])]


def _penalize(logits: torch.Tensor, penalized: list[tuple[int, Sampling, LogitsContext]]) -> None:
    """Step 5 for every penalized row of the batch at once: one dedup, one kernel launch.

    The entries are gathered with numpy, which turns a list of ints into an array several times
    faster than torch.tensor does; each item's tokens are converted once, whatever its rows."""
    rows, tokens, generated = [], [], []
    num_rows = logits.shape[0]
    presence, frequency, repetition = np.zeros(num_rows, np.float32), np.zeros(num_rows, np.float32), np.ones(
        num_rows, np.float32)
    for first, sampling, context in penalized:
        committed = np.fromiter(context.tokens, np.int64, len(context.tokens))  # [n]
        drafts = np.fromiter(context.drafts, np.int64, len(context.drafts))  # [k]
        for i in range(context.num_rows):
            size = len(committed) + i
            tokens += (committed, drafts[:i])
            rows.append(np.full(size, first + i, np.int64))
            generated.append(np.arange(size) >= context.prompt_len)
        span = slice(first, first + context.num_rows)
        presence[span], frequency[span] = sampling.presence_penalty, sampling.frequency_penalty
        repetition[span] = sampling.repetition_penalty
    device = logits.device
    entries = penalty_entries(*(torch.from_numpy(np.concatenate(parts)).to(device) for parts in (rows, tokens, generated)),
                              logits.shape[1])
    apply_penalties(logits, entries, RowPenalties(*(torch.from_numpy(p).to(device) for p in (presence, frequency, repetition))))
