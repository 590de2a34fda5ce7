"""Draft proposals: validated on arrival, then matched against the committed tokens, salvaged when stale."""
from __future__ import annotations

from dataclasses import dataclass

from kernels.compression import CompressedProbs, InvalidDraftProbs, unpack
from target_service.sequence import Sequence
from tandem.v1 import drafter_pb2


@dataclass(frozen=True, slots=True)
class Proposal:
    """Validated drafts: tokens[i] is a guess for position base_len + i."""

    base_len: int
    tokens: tuple[int, ...]
    probs: CompressedProbs | None  # [len(tokens), K] q' rows; None when ids suffice
    received_at: float


class InvalidProposal(ValueError):
    """A proposal the target must drop; `reason` labels the rejected-proposals metric."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def validate_proposal(
    msg: drafter_pb2.DraftProposal,
    seq: Sequence,
    vocab_size: int,
    max_k: int,
    probs_top_k: int,
    now: float,
) -> Proposal:
    """Checks everything the drafter sent for one sequence; raises InvalidProposal."""
    tokens = tuple(msg.token_ids)
    if not tokens or len(tokens) > max_k:
        raise InvalidProposal("length", f"{len(tokens)} draft tokens; expected 1 to {max_k}")
    if max(tokens) >= vocab_size:
        raise InvalidProposal("token_id", f"draft token {max(tokens)} is outside the vocabulary of {vocab_size}")
    if not len(seq.prompt_ids) <= msg.base_len <= len(seq.token_ids):
        raise InvalidProposal(
            "base_len", f"base_len {msg.base_len} is outside [{len(seq.prompt_ids)}, {len(seq.token_ids)}]"
        )
    probs = None
    if seq.options.needs_draft_probs:
        if msg.probs_top_k != probs_top_k:
            raise InvalidProposal("probs", f"probs_top_k {msg.probs_top_k}; the drafter announced {probs_top_k}")
        try:
            probs = unpack(msg.probs, len(tokens), msg.probs_top_k, vocab_size)
        except InvalidDraftProbs as err:
            raise InvalidProposal("probs", str(err)) from err
    return Proposal(base_len=msg.base_len, tokens=tokens, probs=probs, received_at=now)


@dataclass(frozen=True, slots=True)
class UsableDrafts:
    tokens: tuple[int, ...]
    probs: CompressedProbs | None
    salvaged: bool  # drafted from an older prefix that the committed tokens matched

    def first(self, limit: int) -> UsableDrafts | None:
        """The first `limit` of these drafts; None for none."""
        if limit <= 0:
            return None
        if limit >= len(self.tokens):
            return self
        return UsableDrafts(self.tokens[:limit], _rows(self.probs, slice(0, limit)), self.salvaged)


@dataclass(frozen=True, slots=True)
class ProposalMatch:
    """How a proposal meets a sequence's committed tokens."""

    drafts: UsableDrafts | None  # the drafts that continue them; None for none
    contradicted: bool  # drafted from an older prefix that the committed tokens contradict: never usable


NO_MATCH = ProposalMatch(drafts=None, contradicted=False)


def match_proposal(proposal: Proposal, token_ids: list[int], limit: int) -> ProposalMatch:
    """The proposal's drafts that continue the committed tokens, at most `limit`.

    A proposal drafted from an older prefix is still valid where the committed tokens since then
    equal its first drafts: each draft was drawn given the ones before it (docs/design.md, Stale
    drafts and salvage). Committed tokens that match every draft and go past them (all accepted,
    then the bonus token) used the proposal up: no drafts left, but no contradiction either.
    base_len never exceeds the committed length: validation checks it, and sequences only grow.
    """
    skip = len(token_ids) - proposal.base_len
    since = tuple(token_ids[proposal.base_len:])
    overlap = min(skip, len(proposal.tokens))
    if since[:overlap] != proposal.tokens[:overlap]:
        return ProposalMatch(drafts=None, contradicted=True)
    tokens = proposal.tokens[skip : skip + max(limit, 0)]
    if not tokens:
        return NO_MATCH
    drafts = UsableDrafts(tokens, _rows(proposal.probs, slice(skip, skip + len(tokens))), salvaged=skip > 0)
    return ProposalMatch(drafts=drafts, contradicted=False)


def _rows(probs: CompressedProbs | None, rows: slice) -> CompressedProbs | None:
    return None if probs is None else CompressedProbs(probs.ids[rows], probs.fixed[rows])
