"""Log-probabilities of emitted tokens under the target's raw distribution, as vLLM returns them.

Raw: the log-softmax of the model's logits at the position, before any processing (logits rules,
grammar masks, temperature, top-k, top-p, min-p); vLLM's default `raw_logprobs` mode. They
depend on the position's tokens alone, not on how the token was drawn, so with speculation they
are the target alone's: a verify row i holds the logits the target alone computes after d1..di.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # top alternatives per token, vLLM's default max_logprobs


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One emitted token's log-probability, its rank (1: the most likely), and the top alternatives."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]  # (token, logprob), most likely first


@dataclass(frozen=True, slots=True)
class RowLogprobs:
    """log-softmax rows [R, V] of raw logits and each row's most likely tokens, computed before the
    logits are processed; top_n of them go to the client."""

    logprobs: torch.Tensor  # [R, V] float32
    top_values: torch.Tensor  # [R, max(top_n, 1)], largest first
    top_ids: torch.Tensor  # [R, max(top_n, 1)]
    top_n: int


def row_logprobs(logits: torch.Tensor, top_n: int) -> RowLogprobs:
    """log-softmax [R, V] of logits [R, V], and the top max(top_n, 1) (<= MAX_LOGPROBS) of each row:
    at least one, so that a token's rank is read off the top entries whenever it is among them."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    values, ids = top_entries(logprobs, max(top_n, 1))
    return RowLogprobs(logprobs, values, ids, top_n)


def top_entries(rows: torch.Tensor, n: int, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest entries of each row of rows [R, V] and their indices, largest first: torch.topk's
    answer (up to the order of equal values), at a fraction of its cost on a CPU.

    The n largest lie in the n blocks whose maxima are largest, so a top-k of the block maxima and
    one of those blocks' entries replace a top-k over the whole row."""
    num_rows, vocab = rows.shape
    if vocab <= 4 * n * block:
        return rows.topk(n, dim=-1)
    blocks = -(-vocab // block)
    if vocab % block:  # real vocabularies (49152, 128256) are whole blocks: no copy
        rows = torch.nn.functional.pad(rows, (0, blocks * block - vocab), value=float("-inf"))
    tiles = rows.reshape(num_rows, blocks, block)  # [R, B, block]
    _, best = tiles.amax(dim=-1).topk(n, dim=-1)  # [R, n]
    candidates = tiles.gather(1, best[:, :, None].expand(-1, -1, block)).view(num_rows, n * block)
    values, where = candidates.topk(n, dim=-1)  # [R, n]
    return values, best.gather(1, where // block) * block + where % block


def token_logprobs(rows: RowLogprobs, row_index: list[int], tokens: list[int],
                   top_n: list[int]) -> list[TokenLogprob]:
    """The logprob of tokens[i] at row row_index[i], with its top_n[i] (<= rows.top_n) alternatives.

    rank = 1 + the tokens more likely than it. When the token is at least as likely as the last
    top entry, those are all among the top entries; only other tokens are counted over their row.
    A handful of tokens per step: the top entries come to the host once, and the rest is Python."""
    at, index = torch.tensor([row_index, tokens], dtype=torch.int64, device=rows.logprobs.device)  # [T] each
    chosen = rows.logprobs[at, index].tolist()  # [T]
    top_values, top_ids = rows.top_values.tolist(), rows.top_ids.tolist()  # [R, N]
    ranks = [1 + sum(value > logprob for value in top_values[row]) for row, logprob in zip(row_index, chosen)]
    outside = [i for i, (row, logprob) in enumerate(zip(row_index, chosen)) if logprob < top_values[row][-1]]
    if outside:  # one pass over their rows for them all
        beyond = torch.tensor(outside, dtype=torch.int64, device=at.device)
        counts = (rows.logprobs[at[beyond]] > rows.logprobs[at[beyond], index[beyond]][:, None]).sum(dim=1)
        for i, count in zip(outside, counts.tolist()):
            ranks[i] = 1 + count
    return [TokenLogprob(token, logprob, rank, tuple(zip(top_ids[row][:n], top_values[row][:n])))
            for row, token, logprob, rank, n in zip(row_index, tokens, chosen, ranks, top_n)]


def sequence_logprobs(rows: torch.Tensor, tokens: list[int], top_n: int,
                      to_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      chunk_rows: int = 256) -> list[TokenLogprob]:
    """The logprob of tokens[j] at row j of rows [len(tokens), ...] (a prompt's, each row after the
    tokens before it), with top_n alternatives. rows are logits [P, V], or what to_logits turns into
    logits (a model's final hidden states); chunk_rows rows at a time, so a long prompt needs no
    [P, V] tensor."""
    out: list[TokenLogprob] = []
    for start in range(0, len(tokens), chunk_rows):
        part = tokens[start:start + chunk_rows]
        logits = rows[start:start + len(part)]
        rows_here = row_logprobs(logits if to_logits is None else to_logits(logits), top_n)
        out += token_logprobs(rows_here, list(range(len(part))), part, [top_n] * len(part))
    return out
