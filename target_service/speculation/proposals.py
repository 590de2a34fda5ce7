"""Draft proposals: validated on arrival, then matched against the committed tokens, salvaged when stale."""
from __future__ import annotations

from dataclasses import dataclass

from tandem_kernels.compression import CompressedProbs, InvalidDraftProbs, unpack
from target_service.sequence import Sequence
from target_service.step_items import Drafts, probs_rows
from tandem.protos import MAX_PREDRAFT_DEPTH
from tandem.v1 import drafter_pb2


@dataclass(slots=True)
class HeldProposal:
    """Validated drafts, as the target holds them: tokens[i] is a guess for position base_len + i.

    A pre-draft (from the drafter's speculation cache) also names the tokens it assumes at
    positions known_len .. base_len - 1, beyond the committed tokens the drafter knew: it is
    usable only once the committed tokens there equal them.
    """

    base_len: int
    tokens: tuple[int, ...]
    probs: CompressedProbs | None  # [len(tokens), K] q' rows; None when ids suffice
    assumed: tuple[int, ...] = ()
    used: bool = False  # a step has verified drafts of it
    local: bool = False  # the target's own lookup drafted it (local_drafts.py), not the drafter

    @property
    def known_len(self) -> int:
        """The committed prefix the drafter drafted from, before its assumed tokens."""
        return self.base_len - len(self.assumed)


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
    accepts_assumed: bool = False,
) -> HeldProposal:
    """Checks everything the drafter sent for one sequence; raises InvalidProposal.

    accepts_assumed: whether the sequence was opened for pre-drafts; assumed ids are refused otherwise.
    """
    tokens, assumed = tuple(msg.token_ids), tuple(msg.assumed_ids)
    if not tokens or len(tokens) > max_k:
        raise InvalidProposal("length", f"{len(tokens)} draft tokens; expected 1 to {max_k}")
    if max(tokens + assumed) >= vocab_size:
        raise InvalidProposal("token_id", f"token {max(tokens + assumed)} is outside the vocabulary of {vocab_size}")
    if assumed and not accepts_assumed:
        raise InvalidProposal("assumed", "assumed ids for a sequence not opened for pre-drafts")
    if len(assumed) > MAX_PREDRAFT_DEPTH * (max_k + 1):  # per verification ahead: k drafts accepted, one more token
        raise InvalidProposal("assumed", f"{len(assumed)} assumed ids; expected at most "
                                         f"{MAX_PREDRAFT_DEPTH * (max_k + 1)}")
    known_len = msg.base_len - len(assumed)
    if not len(seq.prompt_ids) <= known_len <= len(seq.token_ids):
        raise InvalidProposal(
            "base_len", f"base_len {msg.base_len} less {len(assumed)} assumed ids is outside "
                        f"[{len(seq.prompt_ids)}, {len(seq.token_ids)}]"
        )
    probs = None
    if seq.options.sampling.needs_draft_probs:
        if not 1 <= msg.probs_top_k <= probs_top_k:
            raise InvalidProposal("probs", f"probs_top_k {msg.probs_top_k}; the drafter announced at most {probs_top_k}")
        try:
            probs = unpack(msg.probs, len(tokens), msg.probs_top_k, vocab_size)
        except InvalidDraftProbs as err:
            raise InvalidProposal("probs", str(err)) from err
    return HeldProposal(base_len=msg.base_len, tokens=tokens, probs=probs, assumed=assumed)


@dataclass(frozen=True, slots=True)
class ProposalMatch:
    """How a proposal meets a sequence's committed tokens."""

    drafts: Drafts | None  # the drafts that continue them; None for none
    contradicted: bool  # the committed tokens contradict its assumed tokens or drafts: never usable
    exhausted: bool = False  # every draft is committed already: all accepted, then the bonus token


NO_MATCH = ProposalMatch(drafts=None, contradicted=False)
EXHAUSTED = ProposalMatch(drafts=None, contradicted=False, exhausted=True)


def match_proposal(proposal: HeldProposal, token_ids: list[int], limit: int) -> ProposalMatch:
    """The proposal's drafts that continue the committed tokens, at most `limit`.

    The proposal's tokens, assumed then drafted, sit at positions known_len on. It is usable
    where the committed tokens from known_len on equal its first tokens and cover every assumed
    one: each draft was drawn given the tokens before it, which now equal the committed ones
    (docs/design/speculation.md, Stale drafts and salvage; docs/design/speculation-cache.md).
    Committed tokens that match every draft and go past them (all accepted, then the bonus token)
    used it up: no drafts left, but no contradiction either. Fewer committed tokens than it
    assumes: pending.
    """
    proposed = proposal.assumed + proposal.tokens
    since = tuple(token_ids[proposal.known_len:])
    overlap = min(len(since), len(proposed))
    if since[:overlap] != proposed[:overlap]:
        return ProposalMatch(drafts=None, contradicted=True)
    skip = len(token_ids) - proposal.base_len  # drafts already committed
    if skip < 0:  # a pre-draft whose assumed tokens are not all committed yet
        return NO_MATCH
    if skip >= len(proposal.tokens):
        return EXHAUSTED
    tokens = proposal.tokens[skip : skip + max(limit, 0)]
    if not tokens:
        return NO_MATCH
    drafts = Drafts(tokens, probs_rows(proposal.probs, slice(skip, skip + len(tokens))), salvaged=skip > 0)
    return ProposalMatch(drafts=drafts, contradicted=False)
