from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SessionDelta(_message.Message):
    __slots__ = ("session_id", "start", "tokens", "request_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ...) -> None: ...

class RoundError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ResyncRequired(_message.Message):
    __slots__ = ("cached_len",)
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    cached_len: int
    def __init__(self, cached_len: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model", "tokenizer_vocab_size", "vocab_hash", "model_vocab_size", "max_context", "eos_token_ids", "active_sessions", "cache_bytes", "max_batch_rounds", "feature_size", "head", "fingerprint", "dtype", "head_fingerprint")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HEAD_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokenizer_vocab_size: int
    vocab_hash: str
    model_vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    active_sessions: int
    cache_bytes: int
    max_batch_rounds: int
    feature_size: int
    head: str
    fingerprint: str
    dtype: str
    head_fingerprint: str
    def __init__(self, model: _Optional[str] = ..., tokenizer_vocab_size: _Optional[int] = ..., vocab_hash: _Optional[str] = ..., model_vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., active_sessions: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., max_batch_rounds: _Optional[int] = ..., feature_size: _Optional[int] = ..., head: _Optional[str] = ..., fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., head_fingerprint: _Optional[str] = ...) -> None: ...
