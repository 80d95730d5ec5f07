"""Request bodies of the OpenAI-compatible API, validated by pydantic, and their translation
into the coordinator's GenerateRequest.

What specdec does not do (tools, logprobs, n > 1, response formats, penalties, batched
prompts) is refused with a 400 naming the field, never silently ignored: unknown fields are
forbidden, and fields OpenAI clients send with neutral values are accepted only with them.
Extensions beyond OpenAI's fields, as vLLM spells them where vLLM has them: `top_k`,
`return_token_ids`; and specdec's own `num_speculative_tokens`, `disable_speculation`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.errors import InvalidArgument
from specdec.v1 import coordinator_pb2

# OpenAI's default for the legacy completions endpoint; chat defaults to the server's limit.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# OpenAI's default temperature: a request that does not ask for greedy decoding samples.
DEFAULT_TEMPERATURE = 1.0
# Chat roles of OpenAI's API and the template role each is rendered as.
INT32_LIMIT = 1 << 31
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Generation(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=INT32_LIMIT)
    seed: int | None = Field(None, ge=0, lt=1 << 64)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Extensions.
    return_token_ids: bool = False
    num_speculative_tokens: int | None = Field(None, ge=1)
    disable_speculation: bool = False

    def _refuse_unsupported(self) -> None:
        if self.n != 1:
            raise InvalidArgument("n: one choice per request is supported (n = 1)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidArgument(f"{name}: not supported (penalties change the target's distribution)")
        if self.logit_bias:
            raise InvalidArgument("logit_bias: not supported")
        if self.stream_options is not None and not self.stream:
            raise InvalidArgument("stream_options: only with stream: true")

    def max_new_tokens(self, default: int, limit: int) -> int:
        value = default if self.max_tokens is None else self.max_tokens
        name = "max_completion_tokens" if getattr(self, "max_completion_tokens", None) is not None else "max_tokens"
        if not 1 <= value <= limit:
            raise InvalidArgument(f"{name}: must be in 1..{limit}, got {value}")
        return value

    def _fill(self, request: coordinator_pb2.GenerateRequest, default_max: int, limit: int) -> None:
        self._refuse_unsupported()
        request.max_new_tokens = self.max_new_tokens(default_max, limit)
        request.temperature = DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        if self.top_p is not None:
            request.top_p = self.top_p
        if self.top_k is not None and self.top_k > 0:  # -1 and 0: no top-k filter (vLLM's -1)
            request.top_k = self.top_k
        if self.seed is not None:
            request.seed = self.seed
        if self.stop is not None:
            request.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop)
        if self.num_speculative_tokens is not None:
            request.num_speculative_tokens = self.num_speculative_tokens
        request.disable_speculation = self.disable_speculation

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[TextPart]


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def to_proto(self, limit: int) -> coordinator_pb2.GenerateRequest:
        if self.logprobs or self.top_logprobs is not None:
            raise InvalidArgument("logprobs: not supported")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        request = coordinator_pb2.GenerateRequest()
        for i, message in enumerate(self.messages):
            role = CHAT_ROLES.get(message.role)
            if role is None:
                raise InvalidArgument(f"messages[{i}].role: one of {sorted(CHAT_ROLES)} is supported, "
                                      f"got {message.role!r}")
            content = message.content if isinstance(message.content, str) else "".join(p.text for p in message.content)
            request.chat.messages.add(role=role, content=content)
        self._fill(request, limit, limit)
        return request


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int = 1
    suffix: str | None = None

    def to_proto(self, limit: int) -> coordinator_pb2.GenerateRequest:
        if self.logprobs is not None:
            raise InvalidArgument("logprobs: not supported")
        if self.echo:
            raise InvalidArgument("echo: not supported")
        if self.best_of != 1:
            raise InvalidArgument("best_of: one candidate per request is supported (best_of = 1)")
        if self.suffix:
            raise InvalidArgument("suffix: not supported")
        request = coordinator_pb2.GenerateRequest()
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidArgument(f"prompt: one prompt per request is supported, got a batch of {len(prompt)}")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("prompt must not be empty")
            request.text = prompt
        else:
            if not prompt:
                raise InvalidArgument("prompt must not be empty")
            bad = [t for t in prompt if not 0 <= t < INT32_LIMIT]
            if bad:
                raise InvalidArgument(f"prompt: token id {bad[0]} is outside the vocabulary")
            request.token_ids.ids.extend(prompt)
        self._fill(request, COMPLETIONS_DEFAULT_MAX_TOKENS, limit)
        return request
