"""The target's messages to the drafter for one sequence: open it, or extend it with committed tokens."""
from __future__ import annotations

from target_service.sequence import Sequence
from tandem.v1 import drafter_pb2


def open_message(seq: Sequence, max_k: int) -> drafter_pb2.SequenceOpen:
    """Opens the sequence with every committed token (the prompt, or more after a reconnect)."""
    seq.drafter_len = len(seq.token_ids)
    o = seq.options
    sampling = drafter_pb2.DraftSampling(temperature=o.temperature, top_k=o.top_k, top_p=o.top_p,
                                         min_p=o.min_p, seed=o.seed, drafter_invariant=o.drafter_invariant)
    k = min(o.num_speculative_tokens, max_k)
    return drafter_pb2.SequenceOpen(seq_id=seq.seq_id, prompt_ids=seq.token_ids, sampling=sampling, k=k)


def extend_message(seq: Sequence, now: float) -> drafter_pb2.SequenceExtend:
    """The tokens committed since the drafter was last told."""
    message = drafter_pb2.SequenceExtend(seq_id=seq.seq_id, start=seq.drafter_len,
                                         token_ids=seq.token_ids[seq.drafter_len:])
    seq.drafter_len = len(seq.token_ids)
    seq.drafter_sent_at = now
    return message
