"""Pre-drafting in-process: the wire field, the drafters' outcome rows and slots, the scheduler's order and fan-out."""
from __future__ import annotations

from draft_service.drafter import Draft
from tandem.v1 import drafter_pb2 as pb


def test_assumed_ids_round_trip_and_proposals_without_them_parse_as_before():
    proposal = pb.DraftProposal(seq_id=3, base_len=12, token_ids=[7, 8], assumed_ids=[5, 6])
    parsed = pb.DraftProposal.FromString(proposal.SerializeToString())
    assert (parsed.base_len, list(parsed.token_ids), list(parsed.assumed_ids)) == (12, [7, 8], [5, 6])
    plain = pb.DraftProposal.FromString(pb.DraftProposal(seq_id=3, base_len=10, token_ids=[7]).SerializeToString())
    assert list(plain.assumed_ids) == []
    assert pb.SequenceOpen.FromString(pb.SequenceOpen(seq_id=1, k=2).SerializeToString()).accepts_assumed is False
    assert Draft((1, 3), base_len=12, token_ids=[7, 8], assumed_ids=[5, 6]).to_proto() == proposal
