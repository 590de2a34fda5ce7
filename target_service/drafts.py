"""Draft proposals: validated on arrival, salvaged or dropped when stale, trimmed to what a step can use."""
from __future__ import annotations

from dataclasses import dataclass

from kernels.compression import CompressedProbs, InvalidDraftProbs, unpack
from target_service.sequence import Proposal, Sequence
from tandem.v1 import drafter_pb2


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


def usable_drafts(seq: Sequence, limit: int) -> UsableDrafts | None:
    """The drafts that continue the committed tokens, at most `limit`; None when there are none.

    A proposal drafted from an older prefix is still valid where the committed tokens since then
    equal its first drafts: each draft was drawn given the ones before it (docs/design.md, Stale drafts and salvage).
    """
    proposal = seq.proposal
    if proposal is None or limit <= 0:
        return None
    committed = len(seq.token_ids)
    skip = committed - proposal.base_len
    if skip < 0 or tuple(seq.token_ids[proposal.base_len:]) != proposal.tokens[:skip]:
        return None
    tokens = proposal.tokens[skip : skip + limit]
    if not tokens:
        return None
    probs = None
    if proposal.probs is not None:
        rows = slice(skip, skip + len(tokens))
        probs = CompressedProbs(proposal.probs.ids[rows], proposal.probs.fixed[rows])
    return UsableDrafts(tokens=tokens, probs=probs, salvaged=skip > 0)


def is_stale_mismatch(seq: Sequence) -> bool:
    """The stored proposal was drafted from an older prefix that the committed tokens contradict.

    Committed tokens that match every draft and go past them (all accepted, then the bonus token)
    used the proposal up: that is no contradiction.
    """
    proposal = seq.proposal
    if proposal is None:
        return False
    since = tuple(seq.token_ids[proposal.base_len:])
    overlap = min(len(since), len(proposal.tokens))
    return since[:overlap] != proposal.tokens[:overlap]
