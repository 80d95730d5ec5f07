from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("delta", "k", "feature_start", "features", "min_draft_prob")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    FEATURE_START_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFT_PROB_FIELD_NUMBER: _ClassVar[int]
    delta: _common_pb2.SessionDelta
    k: int
    feature_start: int
    features: bytes
    min_draft_prob: float
    def __init__(self, delta: _Optional[_Union[_common_pb2.SessionDelta, _Mapping]] = ..., k: _Optional[int] = ..., feature_start: _Optional[int] = ..., features: _Optional[bytes] = ..., min_draft_prob: _Optional[float] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("block", "resync", "error")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    block: DraftBlock
    resync: _common_pb2.ResyncRequired
    error: _common_pb2.RoundError
    def __init__(self, block: _Optional[_Union[DraftBlock, _Mapping]] = ..., resync: _Optional[_Union[_common_pb2.ResyncRequired, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.RoundError, _Mapping]] = ...) -> None: ...

class ProposeBatchRequest(_message.Message):
    __slots__ = ("rounds", "step_id")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    rounds: _containers.RepeatedCompositeFieldContainer[ProposeRequest]
    step_id: int
    def __init__(self, rounds: _Optional[_Iterable[_Union[ProposeRequest, _Mapping]]] = ..., step_id: _Optional[int] = ...) -> None: ...

class ProposeBatchResponse(_message.Message):
    __slots__ = ("results", "step_s", "step_id", "error_code", "error_message")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ProposeResponse]
    step_s: float
    step_id: int
    error_code: int
    error_message: str
    def __init__(self, results: _Optional[_Iterable[_Union[ProposeResponse, _Mapping]]] = ..., step_s: _Optional[float] = ..., step_id: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class DraftBlock(_message.Message):
    __slots__ = ("tokens", "compute_s")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    compute_s: float
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., compute_s: _Optional[float] = ...) -> None: ...
