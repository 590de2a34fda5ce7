from tandem.v1 import structured_pb2 as _structured_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "tokenizer_fingerprint", "max_k", "kind", "probs_top_k", "hidden_layers", "target_hidden_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PROBS_TOP_K_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TARGET_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    tokenizer_fingerprint: str
    max_k: int
    kind: str
    probs_top_k: int
    hidden_layers: _containers.RepeatedScalarFieldContainer[int]
    target_hidden_size: int
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_k: _Optional[int] = ..., kind: _Optional[str] = ..., probs_top_k: _Optional[int] = ..., hidden_layers: _Optional[_Iterable[int]] = ..., target_hidden_size: _Optional[int] = ...) -> None: ...

class DraftSampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "drafter_invariant", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "min_tokens", "min_tokens_banned_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_BANNED_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    drafter_invariant: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[BadWord]
    min_tokens: int
    min_tokens_banned_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., drafter_invariant: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[BadWord, _Mapping]]] = ..., min_tokens: _Optional[int] = ..., min_tokens_banned_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BadWord(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SequenceOpen(_message.Message):
    __slots__ = ("seq_id", "prompt_ids", "sampling", "k", "accepts_assumed", "structured_outputs", "constrained_from", "prompt_len")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_ASSUMED_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_FROM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: DraftSampling
    k: int
    accepts_assumed: bool
    structured_outputs: _structured_pb2.StructuredOutputs
    constrained_from: int
    prompt_len: int
    def __init__(self, seq_id: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[DraftSampling, _Mapping]] = ..., k: _Optional[int] = ..., accepts_assumed: _Optional[bool] = ..., structured_outputs: _Optional[_Union[_structured_pb2.StructuredOutputs, _Mapping]] = ..., constrained_from: _Optional[int] = ..., prompt_len: _Optional[int] = ...) -> None: ...

class SequenceExtend(_message.Message):
    __slots__ = ("seq_id", "start", "token_ids", "hidden_states", "hidden_start", "k")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_START_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_states: bytes
    hidden_start: int
    k: int
    def __init__(self, seq_id: _Optional[int] = ..., start: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., hidden_states: _Optional[bytes] = ..., hidden_start: _Optional[int] = ..., k: _Optional[int] = ...) -> None: ...

class SequenceClose(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    def __init__(self, seq_id: _Optional[int] = ...) -> None: ...

class TargetUpdate(_message.Message):
    __slots__ = ("opens", "extends", "closes", "draft_round_trip_us", "step_interval_us")
    OPENS_FIELD_NUMBER: _ClassVar[int]
    EXTENDS_FIELD_NUMBER: _ClassVar[int]
    CLOSES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ROUND_TRIP_US_FIELD_NUMBER: _ClassVar[int]
    STEP_INTERVAL_US_FIELD_NUMBER: _ClassVar[int]
    opens: _containers.RepeatedCompositeFieldContainer[SequenceOpen]
    extends: _containers.RepeatedCompositeFieldContainer[SequenceExtend]
    closes: _containers.RepeatedCompositeFieldContainer[SequenceClose]
    draft_round_trip_us: int
    step_interval_us: int
    def __init__(self, opens: _Optional[_Iterable[_Union[SequenceOpen, _Mapping]]] = ..., extends: _Optional[_Iterable[_Union[SequenceExtend, _Mapping]]] = ..., closes: _Optional[_Iterable[_Union[SequenceClose, _Mapping]]] = ..., draft_round_trip_us: _Optional[int] = ..., step_interval_us: _Optional[int] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("seq_id", "base_len", "token_ids", "probs", "probs_top_k", "assumed_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    PROBS_TOP_K_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    base_len: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: bytes
    probs_top_k: int
    assumed_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., base_len: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[bytes] = ..., probs_top_k: _Optional[int] = ..., assumed_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftProposals(_message.Message):
    __slots__ = ("proposals", "draft_time_ns")
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    proposals: _containers.RepeatedCompositeFieldContainer[DraftProposal]
    draft_time_ns: int
    def __init__(self, proposals: _Optional[_Iterable[_Union[DraftProposal, _Mapping]]] = ..., draft_time_ns: _Optional[int] = ...) -> None: ...
