"""The target's messages to the drafter for one sequence: open it, or extend it with committed tokens."""
from __future__ import annotations

from target_service.sequence import Sequence
from tandem.v1 import drafter_pb2


def open_message(seq: Sequence, k: int, accepts_assumed: bool) -> drafter_pb2.SequenceOpen:
    """Opens the sequence with every committed token (the prompt, or more after a reconnect).

    accepts_assumed: the target keeps pre-drafts (proposals that assume tokens) for it.
    """
    o, s = seq.options, seq.options.sampling
    sampling = drafter_pb2.DraftSampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                         min_p=s.min_p, seed=s.seed, drafter_invariant=s.drafter_invariant)
    message = drafter_pb2.SequenceOpen(seq_id=seq.seq_id, prompt_ids=seq.token_ids, sampling=sampling, k=k,
                                       accepts_assumed=accepts_assumed)
    if o.constraint is not None:
        message.structured_outputs.CopyFrom(o.constraint.to_proto())
        message.constrained_from = len(seq.prompt_ids)
    return message


def extend_message(seq: Sequence, start: int) -> drafter_pb2.SequenceExtend:
    """The committed tokens from `start`, the length the drafter was last told, on."""
    return drafter_pb2.SequenceExtend(seq_id=seq.seq_id, start=start, token_ids=seq.token_ids[start:])
