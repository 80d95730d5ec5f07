from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("delta", "draft_tokens", "sampling", "return_features", "draft_next")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NEXT_FIELD_NUMBER: _ClassVar[int]
    delta: _common_pb2.SessionDelta
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    return_features: bool
    draft_next: int
    def __init__(self, delta: _Optional[_Union[_common_pb2.SessionDelta, _Mapping]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_features: _Optional[bool] = ..., draft_next: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("verdict", "resync", "error")
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    verdict: Verdict
    resync: _common_pb2.ResyncRequired
    error: _common_pb2.RoundError
    def __init__(self, verdict: _Optional[_Union[Verdict, _Mapping]] = ..., resync: _Optional[_Union[_common_pb2.ResyncRequired, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.RoundError, _Mapping]] = ...) -> None: ...

class VerifyBatchRequest(_message.Message):
    __slots__ = ("rounds", "step_id")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    rounds: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    step_id: int
    def __init__(self, rounds: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ..., step_id: _Optional[int] = ...) -> None: ...

class VerifyBatchResponse(_message.Message):
    __slots__ = ("results", "step_s", "rows", "step_id", "error_code", "error_message", "draft_s")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResponse]
    step_s: float
    rows: int
    step_id: int
    error_code: int
    error_message: str
    draft_s: float
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResponse, _Mapping]]] = ..., step_s: _Optional[float] = ..., rows: _Optional[int] = ..., step_id: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., draft_s: _Optional[float] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("accepted", "next_token", "cached_len", "compute_s", "feature_start", "features", "next_drafts", "extra_tokens")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    FEATURE_START_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    NEXT_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_TOKENS_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    next_token: int
    cached_len: int
    compute_s: float
    feature_start: int
    features: bytes
    next_drafts: _containers.RepeatedScalarFieldContainer[int]
    extra_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., cached_len: _Optional[int] = ..., compute_s: _Optional[float] = ..., feature_start: _Optional[int] = ..., features: _Optional[bytes] = ..., next_drafts: _Optional[_Iterable[int]] = ..., extra_tokens: _Optional[_Iterable[int]] = ...) -> None: ...
