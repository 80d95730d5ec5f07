"""The public API under random and malformed requests (hypothesis): every Generate call ends
with OK or a clear client-side status with a message, never INTERNAL or UNKNOWN, and after
each one a well-behaved client still gets exactly the target's own greedy output.

Requests go out as raw bytes through a generic unary_stream call, so the wire can carry what
the protobuf API refuses to build: invalid UTF-8 in a string field (proto3 strings must be
UTF-8, so the server's parser rejects them), unknown fields, a scalar or the `prompt` oneof
sent twice (the last one wins), unpacked and over-long varints, truncated records.
One stack of real services (tiny models) serves every example on the harness's one loop.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specdec.client import Client, make_request
from specdec.v1 import coordinator_pb2
from tests.factories import TINY_VOCAB, make_tiny_model, make_tiny_tokenizer
from tests.harness import reference_greedy, run, running_stack

GENERATE = "/specdec.v1.Coordinator/Generate"
MAX_EXAMPLES = 1000
# A call that has not ended after this long is a hang, not a slow answer.
HANG_GUARD_S = 30.0
PROBE_PROMPT = "The quick brown fox jumps over the lazy dog."
PROBE_TOKENS = 12
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # ServerConfig.max_message_bytes

StatusCode = grpc.StatusCode
# What a client may be told about a request it got wrong, or one over a limit.
CLIENT_STATUSES = {StatusCode.OK, StatusCode.INVALID_ARGUMENT, StatusCode.RESOURCE_EXHAUSTED,
                   StatusCode.OUT_OF_RANGE}
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
UINT32_MAX, UINT64_MAX = 2**32 - 1, 2**64 - 1
# Byte strings that are not UTF-8: a stray continuation byte, bytes never valid in UTF-8, a
# truncated sequence, an overlong encoding, a UTF-16 surrogate, a code point past U+10FFFF.
BAD_UTF8 = [b"\x80", b"\xff", b"\xfe\xff", b"\xe2\x82", b"\xc3\x28", b"\xc0\xaf", b"\xed\xa0\x80",
            b"\xf4\x90\x80\x80", b"ok\xffok"]
# Placeholder byte of a stop string whose bytes are replaced on the wire by invalid UTF-8.
SPLICE_BYTE = b"\x01"

# Field numbers of GenerateRequest (protos/specdec/v1/coordinator.proto).
F_TEXT, F_CHAT, F_TOKEN_IDS, F_MAX_NEW, F_K, F_NO_SPEC, F_STOP, F_REQUEST_ID = 1, 2, 3, 4, 5, 6, 7, 8
WIRE_VARINT, WIRE_I64, WIRE_LEN, WIRE_I32 = 0, 1, 2, 5


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def record(number: int, wire_type: int, payload: bytes | int) -> bytes:
    """One field on the wire: key, then the varint value or the length-prefixed bytes."""
    key = varint(number << 3 | wire_type)
    if wire_type == WIRE_VARINT:
        return key + varint(payload)
    if wire_type == WIRE_LEN:
        return key + varint(len(payload)) + payload
    return key + payload


# --- what a case is ---------------------------------------------------------------------


@dataclass
class Case:
    """One Generate call: the request bytes, and how the client ends it."""

    request: coordinator_pb2.GenerateRequest
    mutations: list = field(default_factory=list)
    # Cancel after reading this many messages (0: right after the call starts).
    cancel_after: int | None = None
    # A deadline of the client's own (seconds); None: only the hang guard.
    deadline_s: float | None = None

    def payload(self) -> bytes:
        data = self.request.SerializeToString()
        # Splices first: they rewrite bytes that a later truncation may cut.
        for mutation in sorted(self.mutations, key=lambda m: m[0] != "splice_bad_utf8_stop"):
            data = apply_mutation(data, mutation)
        return data

    def _repr_pretty_(self, printer, cycle) -> None:  # how hypothesis prints a failing example
        printer.text(repr(self))

    def __repr__(self) -> str:
        text = repr(self.request)
        if len(text) > 600:
            text = text[:600] + f"... ({len(text)} chars)"
        return (f"Case(request=<{text}>, mutations={self.mutations!r:.600}, cancel_after={self.cancel_after}, "
                f"deadline_s={self.deadline_s})")


def apply_mutation(data: bytes, mutation: tuple) -> bytes:
    kind, *args = mutation
    if kind == "splice_bad_utf8_stop":
        # The request holds a stop string of len(bad) placeholder bytes: same length, so the
        # record's length prefix stays right and only the string's bytes turn invalid.
        (bad,) = args
        placeholder = record(F_STOP, WIRE_LEN, SPLICE_BYTE * len(bad))
        assert placeholder in data
        return data.replace(placeholder, record(F_STOP, WIRE_LEN, bad), 1)
    if kind == "bad_utf8_field":  # a whole string record of invalid UTF-8: stop, request_id, text
        number, prefix, bad, suffix = args
        return data + record(number, WIRE_LEN, prefix.encode() + bad + suffix.encode())
    if kind == "unknown_field":
        number, wire_type, payload = args
        return data + record(number, wire_type, payload)
    if kind == "repeat_scalar":  # a scalar sent twice: the last one wins (values wider than the field truncate)
        number, value = args
        return data + record(number, WIRE_VARINT, value)
    if kind == "second_prompt":  # the oneof set twice: the last one wins (two chats or two id lists merge)
        (other,) = args
        return data + other.SerializeToString()
    if kind == "unpacked_token_ids":  # ids as unpacked varints, any 64-bit value (int32 keeps the low 32 bits)
        (values,) = args
        return data + record(F_TOKEN_IDS, WIRE_LEN, b"".join(record(1, WIRE_VARINT, v) for v in values))
    if kind == "truncate":
        (cut,) = args
        return data[:max(0, len(data) - cut)]
    if kind == "garbage":
        (junk,) = args
        return data + junk
    raise AssertionError(kind)


# --- strategies ---------------------------------------------------------------------------
#
# A case is drawn in one of three modes: every field valid (so generation, stop strings,
# sampling and mid-stream cancels are exercised), one field wild and the rest valid (the
# clearest failures), or every field wild.

def huge(units: list[str], counts: list[int]) -> st.SearchStrategy[str]:
    return st.builds(lambda unit, count: unit * count, st.sampled_from(units), st.sampled_from(counts))


def optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), strategy)


wild_texts = st.one_of(st.just(""), st.text(max_size=60), huge(["a", "é ", "🙂", "the fox "], [300, 3_000]))
valid_roles = st.sampled_from(["system", "user", "assistant"])
wild_roles = st.one_of(valid_roles, st.text(max_size=10), st.sampled_from(["", "tool", "USER", "user ", "assistant\x00"]))
wild_token_ids = st.one_of(
    st.lists(st.one_of(st.integers(0, TINY_VOCAB - 1), st.integers(INT32_MIN, INT32_MAX),
                       st.sampled_from([-1, TINY_VOCAB - 1, TINY_VOCAB, INT32_MAX, INT32_MIN])), max_size=40),
    # Around the tiny model's 256-token context: the last prompt that fits leaves room for 1 token.
    st.integers(250, 260).flatmap(lambda n: st.lists(st.integers(0, TINY_VOCAB - 1), min_size=n, max_size=n)),
)
wild_float32s = optional(st.one_of(
    st.floats(width=32), st.floats(0.0625, 2.0, width=32),
    st.sampled_from([0.0, -0.0, 1.0, 0.5, -1.0, 1e-45, 100.0, 100.00001, 3.4e38, math.inf, -math.inf, math.nan]),
))


@st.composite
def prompts(draw, wild: bool) -> coordinator_pb2.GenerateRequest:
    """A request holding only a prompt: of any kind (or none) when wild."""
    request = coordinator_pb2.GenerateRequest()
    kind = draw(st.sampled_from(["none", "text", "chat", "token_ids"] if wild else ["text", "chat", "token_ids"]))
    if kind == "text":
        request.text = draw(wild_texts if wild else st.text(min_size=1, max_size=60))
    elif kind == "chat":
        request.chat.SetInParent()  # an empty chat is still a chat
        messages = (st.lists(st.tuples(wild_roles, wild_texts), max_size=5) if wild else
                    st.lists(st.tuples(valid_roles, st.text(min_size=1, max_size=40)), min_size=1, max_size=3))
        for role, content in draw(messages):
            request.chat.messages.add(role=role, content=content)
    elif kind == "token_ids":
        request.token_ids.SetInParent()
        ids = wild_token_ids if wild else st.lists(st.integers(0, TINY_VOCAB - 1), min_size=1, max_size=40)
        request.token_ids.ids.extend(draw(ids))
    return request


# Field numbers the request does not define (as a newer client's fields would be).
FIRST_UNKNOWN_FIELD = max(f.number for f in coordinator_pb2.GenerateRequest.DESCRIPTOR.fields) + 1


@st.composite
def mutations(draw, request: coordinator_pb2.GenerateRequest, wild: bool) -> list:
    """Edits of the serialized request; when not wild, only ones that keep it valid."""
    kinds = (["splice_bad_utf8_stop", "bad_utf8_field", "unknown_field", "repeat_scalar", "second_prompt",
              "unpacked_token_ids", "truncate", "garbage"] if wild else
             ["unknown_field", "repeat_scalar", "second_prompt"])
    found = []
    for _ in range(draw(st.integers(1 if wild else 0, 3))):
        kind = draw(st.sampled_from(kinds))
        if kind == "splice_bad_utf8_stop":
            bad = draw(st.sampled_from(BAD_UTF8))
            request.stop.insert(draw(st.integers(0, len(request.stop))), (SPLICE_BYTE * len(bad)).decode())
            found.append((kind, bad))
        elif kind == "bad_utf8_field":
            found.append((kind, draw(st.sampled_from([F_STOP, F_REQUEST_ID, F_TEXT])), draw(st.text(max_size=5)),
                          draw(st.sampled_from(BAD_UTF8)), draw(st.text(max_size=5))))
        elif kind == "unknown_field":
            number = draw(st.integers(FIRST_UNKNOWN_FIELD, 2**29 - 1))
            wire_type = draw(st.sampled_from([WIRE_VARINT, WIRE_I64, WIRE_LEN, WIRE_I32]))
            payload = {WIRE_VARINT: st.integers(0, UINT64_MAX), WIRE_I64: st.binary(min_size=8, max_size=8),
                       WIRE_LEN: st.binary(max_size=40), WIRE_I32: st.binary(min_size=4, max_size=4)}[wire_type]
            found.append((kind, number, wire_type, draw(payload)))
        elif kind == "repeat_scalar":
            number, values = draw(st.sampled_from([(F_MAX_NEW, (1, 40)), (F_K, (1, 16)), (F_NO_SPEC, (0, 1))]))
            found.append((kind, number, draw(st.integers(0, UINT64_MAX) if wild else st.integers(*values))))
        elif kind == "second_prompt":
            found.append((kind, draw(prompts(wild))))
        elif kind == "unpacked_token_ids":
            values = st.lists(st.one_of(st.integers(0, TINY_VOCAB - 1), st.integers(0, UINT64_MAX)), max_size=8)
            found.append((kind, draw(values)))
        elif kind == "truncate":
            found.append((kind, draw(st.integers(1, 8))))
        else:
            found.append((kind, draw(st.binary(min_size=1, max_size=12))))
    return found


FIELDS = {
    # name: (valid values, wild values)
    "max_new_tokens": (st.integers(1, 40), st.one_of(
        st.integers(0, 16), st.integers(0, UINT32_MAX), st.sampled_from([0, 4096, 4097, INT32_MAX, 2**31, UINT32_MAX]))),
    "num_speculative_tokens": (optional(st.integers(1, 16)), optional(st.one_of(
        st.integers(0, UINT32_MAX), st.sampled_from([0, 1, 16, 17, UINT32_MAX])))),
    "disable_speculation": (st.booleans(), st.booleans()),
    "stop": (st.lists(st.text(min_size=1, max_size=4), max_size=3), st.lists(
        st.one_of(st.text(max_size=6), st.sampled_from(["", "a" * 256, "a" * 257]), st.text(min_size=250, max_size=300)),
        max_size=18)),
    "request_id": (st.one_of(st.just(""), st.from_regex(r"[A-Za-z0-9._:/-]{1,64}", fullmatch=True)),
                   st.one_of(st.text(max_size=70), st.from_regex(r"[A-Za-z0-9._:/-]{60,70}", fullmatch=True))),
    "temperature": (st.one_of(st.none(), st.just(0.0), st.floats(0.0625, 2.0, width=32)), wild_float32s),
    "top_p": (optional(st.floats(0.0625, 1.0, width=32)), wild_float32s),
    "top_k": (optional(st.integers(0, 400)), optional(st.integers(INT32_MIN, INT32_MAX))),
    "seed": (optional(st.integers(0, 2**63 - 1)), optional(st.one_of(
        st.integers(0, UINT64_MAX), st.sampled_from([2**63 - 1, 2**63, UINT64_MAX])))),
}


@st.composite
def cases(draw) -> Case:
    mode = draw(st.sampled_from(["valid", "one-fault", "wild"]))
    fault = draw(st.sampled_from(["prompt", "mutations", *FIELDS])) if mode == "one-fault" else None

    def wild(name: str) -> bool:
        return mode == "wild" or fault == name

    request = draw(prompts(wild("prompt")))
    for name, (valid, wild_values) in FIELDS.items():
        value = draw(wild_values if wild(name) else valid)
        if value is not None:
            if name == "stop":
                request.stop.extend(value)
            else:
                setattr(request, name, value)
    found = draw(mutations(request, wild("mutations")))
    cancel_after = draw(st.sampled_from([None] * 5 + [0, 1, 2, 3, 4]))
    deadline_s = draw(st.sampled_from([None] * 8 + [0.001, 0.02, 0.2]))
    return Case(request, found, cancel_after, deadline_s)


# --- running a case -------------------------------------------------------------------------

@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list


async def send(channel: grpc.aio.Channel, case: Case) -> Outcome:
    generate = channel.unary_stream(GENERATE, request_serializer=lambda data: data,
                                    response_deserializer=coordinator_pb2.GenerateResponse.FromString)
    call = generate(case.payload(), timeout=case.deadline_s or HANG_GUARD_S)
    responses = []
    try:
        if case.cancel_after == 0:
            call.cancel()
        else:
            async for response in call:
                responses.append(response)
                if len(responses) == case.cancel_after:
                    call.cancel()
                    break
        return Outcome(await call.code(), await call.details() or "", responses)
    except grpc.aio.AioRpcError as exc:
        return Outcome(exc.code(), exc.details() or "", responses)


def decodes(payload: bytes) -> coordinator_pb2.GenerateRequest | None:
    try:
        return coordinator_pb2.GenerateRequest.FromString(payload)
    except DecodeError:
        return None


def check_outcome(case: Case, outcome: Outcome, vocab_size: int) -> None:
    allowed = set(CLIENT_STATUSES)
    if case.cancel_after is not None:
        allowed.add(StatusCode.CANCELLED)
    if case.deadline_s is not None:
        allowed.add(StatusCode.DEADLINE_EXCEEDED)
    status = f"{outcome.code.name}: {outcome.details!r}"
    if outcome.code == StatusCode.DEADLINE_EXCEEDED and case.deadline_s is None:
        raise AssertionError(f"no answer within {HANG_GUARD_S:g} s: the call hangs")
    assert outcome.code in allowed, status
    if outcome.code != StatusCode.OK:
        assert outcome.details.strip(), f"{outcome.code.name} without a message"
    parsed = decodes(case.payload())
    if parsed is None and outcome.code not in (StatusCode.CANCELLED, StatusCode.DEADLINE_EXCEEDED):
        assert outcome.code == StatusCode.INVALID_ARGUMENT, f"undecodable request answered {status}"
    if outcome.code == StatusCode.OK and case.cancel_after is None:
        check_completion(parsed, outcome.responses, vocab_size)


def check_completion(request: coordinator_pb2.GenerateRequest, responses: list, vocab_size: int) -> None:
    """A completed stream: only its last message finishes it, with stats that add up."""
    assert responses, "OK without a single message"
    *body, last = responses
    assert all(r.finish_reason == coordinator_pb2.FINISH_REASON_UNSPECIFIED for r in body)
    assert last.finish_reason != coordinator_pb2.FINISH_REASON_UNSPECIFIED
    tokens = [t for r in responses for t in r.token_ids]
    assert 1 <= len(tokens) <= request.max_new_tokens
    assert all(0 <= t < vocab_size for t in tokens)
    assert last.stats.generated_tokens == len(tokens)


# --- the stack, shared by every example ----------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    return make_tiny_model(tokenizer, seed=0, layers=2)


@dataclass
class Service:
    stack: object
    channel: grpc.aio.Channel
    client: Client
    expected: list[int]
    vocab_size: int
    seen: Counter

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(f"Service({self.stack.address})")


@pytest.fixture(scope="module")
def service(target, tokenizer):
    # The target drafts for itself: every draft is accepted, so long valid requests take few rounds.
    stack_context = running_stack(target, tokenizer, draft=target)
    stack = run(stack_context.__aenter__())
    probe_ids = list(tokenizer.apply_chat_template([{"role": "user", "content": PROBE_PROMPT}],
                                                   add_generation_prompt=True)["input_ids"])

    async def connect():  # grpc.aio binds a channel to the loop it is made on: the harness's
        return grpc.aio.insecure_channel(stack.address), Client(stack.address)

    channel, client = run(connect())
    seen = Counter()
    try:
        yield Service(stack, channel, client, reference_greedy(target, probe_ids, PROBE_TOKENS),
                      stack.coordinator_servicer.vocab_size, seen)
    finally:
        print("\nstatuses seen:", dict(seen))
        run(channel.close())
        run(client.close())
        run(stack_context.__aexit__(None, None, None))


async def probe(service: Service) -> list[int]:
    result = await service.client.complete(make_request(PROBE_PROMPT, max_new_tokens=PROBE_TOKENS),
                                           timeout=HANG_GUARD_S)
    return result.token_ids


def over_limit_text() -> Case:
    return Case(coordinator_pb2.GenerateRequest(text="a" * (MAX_MESSAGE_BYTES + 1), max_new_tokens=4))


def over_context_text() -> Case:
    return Case(coordinator_pb2.GenerateRequest(text="the fox " * 25_000, max_new_tokens=4))


def million_token_ids() -> Case:
    request = coordinator_pb2.GenerateRequest(max_new_tokens=4)
    request.token_ids.ids.extend([1] * 1_000_000)
    return Case(request)


# --- the properties --------------------------------------------------------------------------

def any_request(test):
    """The property's examples: every generated case, and the three over-limit ones."""
    decorators = [
        settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=False,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.large_base_example]),
        given(case=cases()),
        example(case=over_limit_text()),
        example(case=over_context_text()),
        example(case=million_token_ids()),
    ]
    for decorate in reversed(decorators):
        test = decorate(test)
    return test


@any_request
def test_any_request_gets_a_clear_status(service, case):
    outcome = run(send(service.channel, case))
    service.seen[outcome.code.name] += 1
    check_outcome(case, outcome, service.vocab_size)


@any_request
def test_the_service_keeps_serving_after_any_request(service, case):
    async def scenario():
        await send(service.channel, case)
        return await probe(service)

    assert run(scenario()) == service.expected, "a well-behaved request got other tokens after this one"


@pytest.mark.parametrize("bad", [b"\xff", b"\xc3\x28", b"\xe2\x82", b"\xed\xa0\x80"],
                         ids=["never-valid-byte", "bad-continuation", "truncated", "surrogate"])
def test_stop_string_with_invalid_utf8_gets_invalid_argument(service, bad):
    request = make_request(PROBE_PROMPT, max_new_tokens=4, stop=["x", (SPLICE_BYTE * len(bad)).decode()])
    outcome = run(send(service.channel, Case(request, [("splice_bad_utf8_stop", bad)])))
    assert outcome.code == StatusCode.INVALID_ARGUMENT, f"{outcome.code.name}: {outcome.details!r}"
    assert outcome.details.strip()


def bad_chat(role: bytes, content: bytes) -> bytes:
    message = record(1, WIRE_LEN, role) + record(2, WIRE_LEN, content)
    return record(F_CHAT, WIRE_LEN, record(1, WIRE_LEN, message))


@pytest.mark.parametrize("junk", [
    record(F_TEXT, WIRE_LEN, b"hello \xff"),
    record(F_REQUEST_ID, WIRE_LEN, b"id-\xff"),
    bad_chat(b"user", b"hello \xff"),
    bad_chat(b"us\xffer", b"hello"),
    b"\xff\xff\xff",  # a varint that never ends
    record(F_TEXT, WIRE_LEN, b"hello")[:-2],  # a string cut short
    varint(50 << 3 | 3),  # a group start (proto2 only) that never ends
], ids=["text-utf8", "request-id-utf8", "chat-content-utf8", "chat-role-utf8", "corrupt-varint", "truncated-string",
        "unclosed-group"])
def test_undecodable_request_gets_invalid_argument(service, junk):
    request = make_request(PROBE_PROMPT, max_new_tokens=4)
    outcome = run(send(service.channel, Case(request, [("garbage", junk)])))
    assert outcome.code == StatusCode.INVALID_ARGUMENT, f"{outcome.code.name}: {outcome.details!r}"
    assert outcome.details.strip()


def test_no_worker_session_outlives_its_request(service):
    """Cancelled, refused and finished requests alike free their worker caches."""
    stores = [service.stack.target_servicer.store, service.stack.draft_servicer.store]

    async def settle(timeout_s: float = 5.0) -> None:
        # The last cancelled call's handler may still be unwinding: wait for its release.
        for _ in range(int(timeout_s / 0.05)):
            await service.stack.coordinator_servicer.runner.drain()
            if not any(len(store) for store in stores):
                return
            await asyncio.sleep(0.05)

    run(settle())
    assert [len(store) for store in stores] == [0, 0]
