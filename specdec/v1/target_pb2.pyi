from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("delta", "draft_tokens", "sampling", "return_features", "draft_next", "run_ahead", "token_room", "stop_token_ids", "min_draft_prob")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NEXT_FIELD_NUMBER: _ClassVar[int]
    RUN_AHEAD_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ROOM_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFT_PROB_FIELD_NUMBER: _ClassVar[int]
    delta: _common_pb2.SessionDelta
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    return_features: bool
    draft_next: int
    run_ahead: int
    token_room: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_draft_prob: float
    def __init__(self, delta: _Optional[_Union[_common_pb2.SessionDelta, _Mapping]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_features: _Optional[bool] = ..., draft_next: _Optional[int] = ..., run_ahead: _Optional[int] = ..., token_room: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., min_draft_prob: _Optional[float] = ...) -> None: ...

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
    __slots__ = ("rounds", "step_id", "run_changes")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_CHANGES_FIELD_NUMBER: _ClassVar[int]
    rounds: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    step_id: int
    run_changes: _containers.RepeatedCompositeFieldContainer[RunChange]
    def __init__(self, rounds: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ..., step_id: _Optional[int] = ..., run_changes: _Optional[_Iterable[_Union[RunChange, _Mapping]]] = ...) -> None: ...

class RunChange(_message.Message):
    __slots__ = ("session_id", "run_id", "draft_next", "min_draft_prob", "more_rounds")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NEXT_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFT_PROB_FIELD_NUMBER: _ClassVar[int]
    MORE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    run_id: int
    draft_next: int
    min_draft_prob: float
    more_rounds: int
    def __init__(self, session_id: _Optional[str] = ..., run_id: _Optional[int] = ..., draft_next: _Optional[int] = ..., min_draft_prob: _Optional[float] = ..., more_rounds: _Optional[int] = ...) -> None: ...

class VerifyBatchResponse(_message.Message):
    __slots__ = ("results", "step_s", "rows", "step_id", "error_code", "error_message", "draft_s", "continued", "ahead_rounds", "ahead_drafts", "ahead_drafting", "ahead_head_rounds")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FIELD_NUMBER: _ClassVar[int]
    AHEAD_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    AHEAD_DRAFTING_FIELD_NUMBER: _ClassVar[int]
    AHEAD_HEAD_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResponse]
    step_s: float
    rows: int
    step_id: int
    error_code: int
    error_message: str
    draft_s: float
    continued: _containers.RepeatedCompositeFieldContainer[Continued]
    ahead_rounds: int
    ahead_drafts: int
    ahead_drafting: int
    ahead_head_rounds: int
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResponse, _Mapping]]] = ..., step_s: _Optional[float] = ..., rows: _Optional[int] = ..., step_id: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., draft_s: _Optional[float] = ..., continued: _Optional[_Iterable[_Union[Continued, _Mapping]]] = ..., ahead_rounds: _Optional[int] = ..., ahead_drafts: _Optional[int] = ..., ahead_drafting: _Optional[int] = ..., ahead_head_rounds: _Optional[int] = ...) -> None: ...

class Continued(_message.Message):
    __slots__ = ("session_id", "context_len", "draft_tokens", "result", "run_id", "drafted_with")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_WITH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    context_len: int
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    result: VerifyResponse
    run_id: int
    drafted_with: int
    def __init__(self, session_id: _Optional[str] = ..., context_len: _Optional[int] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., result: _Optional[_Union[VerifyResponse, _Mapping]] = ..., run_id: _Optional[int] = ..., drafted_with: _Optional[int] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("accepted", "next_token", "cached_len", "compute_s", "feature_start", "features", "next_drafts", "extra_tokens", "run_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    FEATURE_START_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    NEXT_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    next_token: int
    cached_len: int
    compute_s: float
    feature_start: int
    features: bytes
    next_drafts: _containers.RepeatedScalarFieldContainer[int]
    extra_tokens: _containers.RepeatedScalarFieldContainer[int]
    run_id: int
    def __init__(self, accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., cached_len: _Optional[int] = ..., compute_s: _Optional[float] = ..., feature_start: _Optional[int] = ..., features: _Optional[bytes] = ..., next_drafts: _Optional[_Iterable[int]] = ..., extra_tokens: _Optional[_Iterable[int]] = ..., run_id: _Optional[int] = ...) -> None: ...
