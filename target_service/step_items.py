"""What a step hands the model runner, and what it gets back, for each sequence in it.

The model runner and the speculation package both use these, so that neither imports the other:
the Speculator's plan builds the VerifyItems of a step, the runner runs them, and the Speculator
and the engine read the ItemResults.
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
class PrefillItem:
    slot: int
    prompt_ids: list[int]
    sampling: Sampling
    grammar: Matcher | None = None
    logits_context: LogitsContext | None = None  # penalties, bans, biases: None when none applies
    logprobs: int | None = None  # top log-probabilities to return with the token; None: none
    prompt_logprobs: int | None = None  # the same for each prompt token from the second on; None: none
    copy_of: int | None = None  # the batch index of an item with the same prompt: share its KV, sample its row
    cached: int = 0  # the prompt's first tokens whose KV the slot holds already: they do not run

    @property
    def num_logits(self) -> int:
        """Every position's logits from `cached` on when its prompt's logprobs are asked; else the last one's."""
        return 1 if self.prompt_logprobs is None else len(self.prompt_ids) - self.cached

    @property
    def scored(self) -> list[int]:
        """The prompt tokens its rows score, when its prompt's logprobs are asked: row j scores the token after it."""
        return self.prompt_ids[self.cached + 1:]


@dataclass(frozen=True, slots=True)
class PromptPart:
    """Positions [start, end) of a prompt that goes on in a later step (chunked prefill): its KV is
    written and nothing is sampled; with prompt_logprobs, prompt tokens start + 1 .. end are scored.
    The scheduler makes it, the runner runs it, and the scheduler's update advances its sequence."""

    seq_id: int
    slot: int
    prompt_ids: list[int]
    start: int
    end: int
    prompt_logprobs: int | None = None

    @property
    def num_logits(self) -> int:
        """Its rows when its prompt's logprobs are asked; else the one row a forward returns (unread)."""
        return 1 if self.prompt_logprobs is None else self.end - self.start

    @property
    def chunk(self) -> SequenceChunk:
        return SequenceChunk(slot=self.slot, start=self.start, token_ids=self.prompt_ids[self.start:self.end],
                             num_logits=self.num_logits)

    @property
    def scored(self) -> list[int]:
        return self.prompt_ids[self.start + 1:self.end + 1]


@dataclass(frozen=True, slots=True)
class VerifyItem:
    slot: int
    length: int  # n, the committed length
    last_token: int
    drafts: Drafts | None
    sampling: Sampling
    grammar: Matcher | None = None
    logits_context: LogitsContext | None = None  # its drafts are the context's: row i follows d1..di
    logprobs: int | None = None  # top log-probabilities to return with each token; None: none
    replay: tuple[int, ...] = ()  # committed tokens before last_token whose KV the slot lacks (after a preemption)

    @property
    def num_drafts(self) -> int:
        return 0 if self.drafts is None else len(self.drafts.tokens)


@dataclass(frozen=True, slots=True)
class ItemResult:
    tokens: list[int]  # accepted drafts, then the recovered or bonus token
    num_accepted: int
    # With capture layers: the target's features at the chunk's positions, bf16 [rows, layers, hidden]
    # (a prefill's prompt positions; a verify's n-1 .. n-1+k, of which the committed ones are sent).
    features: torch.Tensor | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the item asked for them
    # A prefill's, when asked: for prompt tokens cached + 1 .. (a part's: start + 1 .. end)
    prompt_logprobs: list[TokenLogprob] | None = None
