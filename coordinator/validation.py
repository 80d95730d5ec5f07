"""Turns a GenerateRequest into a GenerationPlan, or an InvalidArgument naming the field."""

from __future__ import annotations

import re
import uuid

from coordinator.rounds import GenerationPlan
from specdec.config import CoordinatorConfig
from specdec import sampling
from specdec.errors import FailedPrecondition, InvalidArgument
from specdec.v1 import coordinator_pb2

CHAT_ROLES = {"system", "user", "assistant"}
# Characters per token no real prompt averages more than: text beyond max_prompt_tokens
# times this is refused before it is tokenized (tokenizing megabytes costs seconds of CPU).
MAX_CHARS_PER_TOKEN = 32
MAX_REQUEST_ID_CHARS = 64
# Request ids travel in gRPC metadata and logs: printable ASCII without spaces only.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:/-]{1,%d}" % MAX_REQUEST_ID_CHARS)


def render_prompt(request: coordinator_pb2.GenerateRequest, tokenizer, vocab_size: int,
                  max_prompt_tokens: int = 1 << 30) -> list[int]:
    """The prompt's token ids (and resume_token_ids checked against the vocabulary)."""
    bad = [t for t in request.resume_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"resume_token_ids: id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}")
    kind = request.WhichOneof("prompt")
    chars = len(request.text) if kind == "text" else sum(len(m.content) for m in request.chat.messages)
    if chars > max_prompt_tokens * MAX_CHARS_PER_TOKEN:
        raise InvalidArgument(f"prompt: {chars} characters cannot fit the limit of {max_prompt_tokens} tokens")
    if kind is None:
        raise InvalidArgument("prompt: set one of text, chat or token_ids")
    if kind == "text":
        if not request.text:
            raise InvalidArgument("prompt.text must not be empty")
        ids = list(tokenizer(request.text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise InvalidArgument("prompt.text tokenizes to no tokens")
        return ids
    if kind == "chat":
        messages = request.chat.messages
        if not messages:
            raise InvalidArgument("prompt.chat.messages must not be empty")
        for i, message in enumerate(messages):
            if message.role not in CHAT_ROLES:
                raise InvalidArgument(
                    f"prompt.chat.messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {message.role!r}"
                )
        if not any(m.content for m in messages):
            raise InvalidArgument("prompt.chat.messages: every message is empty")
        if not getattr(tokenizer, "chat_template", None):
            raise FailedPrecondition("prompt.chat: the target's tokenizer has no chat template; send prompt.text")
        try:
            rendered = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True
            )
        except Exception as exc:  # jinja2.TemplateError: e.g. "roles must alternate"
            raise InvalidArgument(f"prompt.chat: the chat template refused the messages: {exc}") from exc
        ids = [int(t) for t in (rendered["input_ids"] if hasattr(rendered, "keys") else rendered)]
        if not ids:
            raise InvalidArgument("prompt.chat renders to no tokens")
        return ids
    ids = list(request.token_ids.ids)
    if not ids:
        raise InvalidArgument("prompt.token_ids must not be empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"prompt.token_ids: id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}")
    return ids


def request_id_of(request: coordinator_pb2.GenerateRequest, metadata_id: str) -> str:
    """The request's id: its field, else the x-request-id metadata, else a new one."""
    for name, value in (("request_id", request.request_id), ("x-request-id metadata", metadata_id)):
        if value:
            if not REQUEST_ID_PATTERN.fullmatch(value):
                raise InvalidArgument(f"{name}: 1..{MAX_REQUEST_ID_CHARS} characters of A-Z a-z 0-9 . _ : / -")
            return value
    return uuid.uuid4().hex[:16]


def plan_request(request: coordinator_pb2.GenerateRequest, prompt_ids: list[int], config: CoordinatorConfig,
                 eos_ids: frozenset[int], max_context: int, request_id: str = "") -> GenerationPlan:
    if not 1 <= request.max_new_tokens <= config.max_new_tokens_limit:
        raise InvalidArgument(
            f"max_new_tokens must be in 1..{config.max_new_tokens_limit}, got {request.max_new_tokens}"
        )
    k = config.default_k
    if request.HasField("num_speculative_tokens"):
        k = request.num_speculative_tokens
        if not 1 <= k <= config.max_k:
            raise InvalidArgument(f"num_speculative_tokens (k) must be in 1..{config.max_k}, got {k}")
    if len(request.stop) > config.max_stop_strings:
        raise InvalidArgument(f"stop: at most {config.max_stop_strings} strings, got {len(request.stop)}")
    for i, stop in enumerate(request.stop):
        if not stop or len(stop) > config.max_stop_string_chars:
            raise InvalidArgument(f"stop[{i}] must be 1..{config.max_stop_string_chars} characters")
    if len(prompt_ids) > config.max_prompt_tokens:
        raise InvalidArgument(f"prompt: {len(prompt_ids)} tokens exceed the limit of {config.max_prompt_tokens}")
    if len(prompt_ids) >= max_context:
        raise InvalidArgument(
            f"prompt: {len(prompt_ids)} tokens do not fit the model's context of {max_context} tokens"
        )
    resumed = check_resume(request, prompt_ids, eos_ids, max_context)
    return GenerationPlan(
        request_id=request_id or request_id_of(request, ""),
        prompt_ids=prompt_ids,
        max_new_tokens=request.max_new_tokens,
        k=k,
        speculate=not request.disable_speculation,
        stop=list(request.stop),
        eos_ids=eos_ids,
        max_context=max_context,
        sampling=sampling.from_request(request),
        resumed=resumed,
    )


def check_resume(request: coordinator_pb2.GenerateRequest, prompt_ids: list[int], eos_ids: frozenset[int],
                 max_context: int) -> list[int]:
    """The tokens a resumed request already streamed (resume_token_ids): they must leave
    something to generate, and a sampled request must name its seed (without it the rest
    of the stream could not be the one the client was receiving). A stop string in their
    text is caught when the runner replays them (coordinator.rounds)."""
    resumed = list(request.resume_token_ids)
    if not resumed:
        return resumed
    if len(resumed) >= request.max_new_tokens:
        raise InvalidArgument(f"resume_token_ids: {len(resumed)} ids leave nothing to generate "
                              f"(max_new_tokens {request.max_new_tokens})")
    if len(prompt_ids) + len(resumed) >= max_context:
        raise InvalidArgument(f"resume_token_ids: the prompt and {len(resumed)} ids fill the model's context of "
                              f"{max_context} tokens: nothing left to generate")
    for i, token in enumerate(resumed):
        if token in eos_ids:
            raise InvalidArgument(f"resume_token_ids[{i}] is the end-of-sequence token {token}: the request "
                                  "had finished")
    if not request.HasField("seed") and request.HasField("temperature") and request.temperature > 0:
        raise InvalidArgument("resume_token_ids: a sampled request resumes only with its seed (the first "
                              "response's seed)")
    return resumed
