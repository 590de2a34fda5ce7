"""What a step hands the model runner, and what it gets back, for each sequence in it.

The model runner and the speculation package both use these, so that neither imports the other:
a Sequence makes its Chunks (the scheduler asks for a prompt's, the Speculator's plan for a running
sequence's), the runner runs them, and the Speculator and the engine read the ChunkResults.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem_kernels.compression import CompressedProbs
from tandem_kernels.logits_processors import LogitsContext
from tandem_kernels.logprobs import TokenLogprob
from tandem_kernels.sampling import Sampling
from tandem.model.batch import SequenceChunk
from tandem.structured.grammar import Matcher


@dataclass(frozen=True, slots=True)
class Drafts:
    """What a step verifies of a sequence's held proposal: draft tokens, and their q' rows when needed."""

    tokens: tuple[int, ...]
    probs: CompressedProbs | None  # [len(tokens), K]; None when ids suffice
    salvaged: bool  # drafted from an older prefix that the committed tokens matched

    def first(self, limit: int) -> Drafts | None:
        """The first `limit` of these drafts; None for none."""
        if limit <= 0:
            return None
        if limit >= len(self.tokens):
            return self
        return Drafts(self.tokens[:limit], probs_rows(self.probs, slice(0, limit)), self.salvaged)


def probs_rows(probs: CompressedProbs | None, rows: slice) -> CompressedProbs | None:
    """Some rows of q'; None for drafts verified by their ids alone."""
    return None if probs is None else probs.rows(rows)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One sequence's part of a step, the model runner's one input: token_ids run at positions
    start .. end - 1, and their KV is written.

    A chunk that samples ends at its sequence's committed length: the row of its last token, then
    one row per draft, are verified (with no drafts, a plain sample), and one token is added after
    the accepted ones. That is a prompt's last chunk (its first token, at the prompt's end), or a
    running sequence's step (its newest token, after the tokens it replays when back from a
    preemption). A prompt's earlier chunk (chunked prefill) samples nothing. With prompt_logprobs,
    a prompt chunk's every row scores the prompt token after it. The scheduler makes a prompt's
    (Sequence.prompt_chunk) and the Speculator's plan a running sequence's (Sequence.running_chunk);
    the scheduler's update advances their sequences after the step.
    """

    seq_id: int
    slot: int
    start: int
    token_ids: tuple[int, ...]  # committed tokens: part of a prompt, or a running sequence's replay and newest
    sampling: Sampling
    samples: bool = True  # False: an earlier chunk of a prompt, which only writes KV (and scores, when asked)
    drafts: Drafts | None = None
    grammar: Matcher | None = None
    logits_context: LogitsContext | None = None  # penalties, bans, biases; row i follows d1..di. None: none apply
    logprobs: int | None = None  # top log-probabilities to return with each token added; None: none
    prompt_logprobs: int | None = None  # the same for each prompt token its rows score; None: none
    scored: tuple[int, ...] = ()  # with prompt_logprobs: the prompt tokens its rows score, row j the one after it
    replayed: int = 0  # leading tokens run again after a preemption: their features were sent before
    # Another sample's chunk of the same prompt, by its index in the same call (an earlier one):
    # this one runs nothing, shares its KV and samples its last row.
    copy_of: int | None = None

    @property
    def end(self) -> int:
        """The positions the slot holds KV for after the step; a sampling chunk's committed length."""
        return self.start + len(self.token_ids)

    @property
    def num_drafts(self) -> int:
        return 0 if self.drafts is None else len(self.drafts.tokens)

    @property
    def draft_tokens(self) -> tuple[int, ...]:
        return () if self.drafts is None else self.drafts.tokens

    @property
    def num_logits(self) -> int:
        """Its logits rows: every position's when prompt logprobs are asked, else its last token's;
        then one per draft. (An earlier chunk's one row is left unread.)"""
        return (len(self.token_ids) if self.prompt_logprobs is not None else 1) + self.num_drafts

    @property
    def forward(self) -> SequenceChunk:
        """What the model runs: the tokens, then the drafts."""
        return SequenceChunk(slot=self.slot, start=self.start, token_ids=[*self.token_ids, *self.draft_tokens],
                             num_logits=self.num_logits)


@dataclass(frozen=True, slots=True)
class ChunkResult:
    tokens: list[int]  # accepted drafts, then the recovered or bonus token
    num_accepted: int
    # With capture layers: the target's features at the chunk's positions, bf16 [rows, layers, hidden]
    # (a prompt chunk's positions; a running sequence's n-1 .. n-1+k, of which the committed ones are sent).
    features: torch.Tensor | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the chunk asked for them
    # A prompt chunk's, when asked: for the prompt tokens it scores (Chunk.scored)
    prompt_logprobs: list[TokenLogprob] | None = None
