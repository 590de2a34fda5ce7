"""The target's messages to the drafter for one sequence: open it, or extend it with committed tokens."""
from __future__ import annotations

from target_service.sequence import Sequence
from tandem.v1 import drafter_pb2


def open_message(seq: Sequence, k: int, accepts_assumed: bool) -> drafter_pb2.SequenceOpen:
    """Opens the sequence with every committed token (the prompt, or more after a reconnect).

    accepts_assumed: the target keeps pre-drafts (proposals that assume tokens) for it.
    """
    o = seq.options
    message = drafter_pb2.SequenceOpen(seq_id=seq.seq_id, prompt_ids=seq.token_ids, sampling=_sampling(seq), k=k,
                                       accepts_assumed=accepts_assumed, prompt_len=len(seq.prompt_ids))
    if o.constraint is not None:
        message.structured_outputs.CopyFrom(o.constraint.to_proto())
        message.constrained_from = len(seq.prompt_ids)
    return message


def _sampling(seq: Sequence) -> drafter_pb2.DraftSampling:
    s = seq.options.sampling
    message = drafter_pb2.DraftSampling(
        temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, seed=s.seed,
        drafter_invariant=s.drafter_invariant, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
        logit_bias=dict(s.logit_bias), allowed_token_ids=s.allowed_token_ids,
        bad_words=[drafter_pb2.BadWord(token_ids=word) for word in s.bad_words])
    if seq.options.min_tokens:
        message.min_tokens = seq.options.min_tokens
        message.min_tokens_banned_ids.extend(sorted(seq.stops.stop_token_ids))
    return message


def extend_message(seq: Sequence, start: int) -> drafter_pb2.SequenceExtend:
    """The committed tokens from `start`, the length the drafter was last told, on."""
    return drafter_pb2.SequenceExtend(seq_id=seq.seq_id, start=start, token_ids=seq.token_ids[start:])
