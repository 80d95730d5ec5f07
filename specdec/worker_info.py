"""The WorkerInfo both workers report, and the tokenizer-compatibility check the
coordinator runs on them at start."""

from __future__ import annotations

import grpc

import logging

from specdec import metrics
from specdec.errors import FailedPrecondition, SpecdecError
from specdec.models import (
    eos_token_ids, fingerprint_config, max_context, vocab_hash, weights_dtype, weights_fingerprint,
)
from specdec.step_streams import StepStreams
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)
# Most rounds one batched call may carry, unless the worker is configured otherwise.
DEFAULT_MAX_BATCH_ROUNDS = 64


def round_error(exc: BaseException, request_id: str = "") -> common_pb2.RoundError:
    """One failed round of a batched call, as the status the round alone would have got:
    typed errors keep their code and message; anything else is this worker's fault
    (INTERNAL, logged here with its traceback, never sent)."""
    if isinstance(exc, SpecdecError):
        return common_pb2.RoundError(code=exc.code.value[0], message=str(exc))
    log.error("a batched round failed (request %s)", request_id or "-", exc_info=exc)
    return common_pb2.RoundError(code=grpc.StatusCode.INTERNAL.value[0],
                                 message=f"the worker failed this round ({type(exc).__name__})")


def model_info(spec: str, model, tokenizer) -> common_pb2.WorkerInfo:
    """What a worker serving `model` (as loaded, not its serving copy) reports, its weights
    fingerprint included (taken here, once, at load)."""
    info = common_pb2.WorkerInfo(
        model=spec,
        tokenizer_vocab_size=len(tokenizer),
        vocab_hash=vocab_hash(tokenizer),
        model_vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        max_context=max_context(model),
        eos_token_ids=eos_token_ids(model, tokenizer),
        fingerprint=weights_fingerprint(model, fingerprint_config(model)),
        dtype=weights_dtype(model),
    )
    log.info("serving %s: %s weights, fingerprint %s", spec, info.dtype, info.fingerprint)
    return info


def check_compatible(target: common_pb2.WorkerInfo, draft: common_pb2.WorkerInfo | None,
                     tokenizer_size: int, tokenizer_hash: str) -> None:
    """Raises FailedPrecondition, naming both sides, when the draft's or the coordinator's
    tokenizer differs from the target's: drafts would be ids of other strings."""
    sides = [("coordinator tokenizer", tokenizer_size, tokenizer_hash)]
    if draft is not None and draft.vocab_hash:  # the n-gram drafter has no tokenizer
        sides.append((f"draft model {draft.model!r}", draft.tokenizer_vocab_size, draft.vocab_hash))
    for name, size, digest in sides:
        if size != target.tokenizer_vocab_size or digest != target.vocab_hash:
            raise FailedPrecondition(
                f"tokenizer mismatch: {name} has {size} tokens (vocab hash {digest[:12]}) but "
                f"target model {target.model!r} has {target.tokenizer_vocab_size} tokens "
                f"(vocab hash {target.vocab_hash[:12]}); draft and target must share a tokenizer"
            )


class SessionWorkerRpcs:
    """Release and GetInfo, the same on both workers, and the servicer's step streams.
    Mixed into each worker's servicer, which provides `kind` ("target" or "draft", its
    metrics label), `store` (SessionStore), `thread` (ModelThread) and `_info`."""

    @property
    def streams(self) -> StepStreams:
        """The servicer's open step streams (VerifyStream / ProposeStream), which drain with
        its server (a companion of it: serving.RunningServer.companions)."""
        streams = self.__dict__.get("_step_streams")
        if streams is None:
            streams = self._step_streams = StepStreams(self.kind)
        return streams

    async def Release(self, request: common_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.ReleaseResponse:
        released = await self.thread.run(self._release, request.session_id)
        return common_pb2.ReleaseResponse(released=released)

    def _release(self, session_id: str) -> bool:
        # On the model thread, which owns the store; the cache gauges drop what it freed.
        released = self.store.release(session_id)
        if released:
            metrics.observe_store(self.kind, self.store, self.store.evictions)
        return released

    async def GetInfo(self, request: common_pb2.WorkerInfoRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.WorkerInfo:
        info = common_pb2.WorkerInfo()
        info.CopyFrom(self._info)
        # The store belongs to the model thread: read it there, never from the event loop.
        info.active_sessions, info.cache_bytes = await self.thread.run(
            lambda: (len(self.store), self.store.cache_bytes()))
        return info
