"""Sampling parameters: validated once at the coordinator, carried to the target as
SamplingParams, applied by the target worker's warp + verification ops."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from specdec.errors import InvalidArgument
from specdec.v1 import common_pb2, coordinator_pb2

MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63 - 1  # Philox keys are built from the seed's two 32-bit halves; keep it int64


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_proto(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                         seed=self.seed)

    @classmethod
    def from_proto(cls, params: common_pb2.SamplingParams | None) -> Sampling:
        if params is None or params.temperature == 0.0:
            return GREEDY
        sampling = cls(params.temperature, params.top_k, params.top_p, params.seed)
        sampling.check("sampling.")
        return sampling

    def check(self, prefix: str = "") -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidArgument(f"{prefix}temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"{prefix}top_k must be >= 0 (0: off), got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"{prefix}top_p must be in (0, 1] (1: off), got {self.top_p}")
        if not 0 <= self.seed <= MAX_SEED:
            raise InvalidArgument(f"{prefix}seed must be in 0..{MAX_SEED}, got {self.seed}")


GREEDY = Sampling()


def from_request(request: coordinator_pb2.GenerateRequest) -> Sampling:
    """The request's sampling parameters; a random seed when sampling without one."""
    temperature = request.temperature if request.HasField("temperature") else 0.0
    top_k = request.top_k if request.HasField("top_k") else 0
    top_p = request.top_p if request.HasField("top_p") else 1.0
    seed = request.seed if request.HasField("seed") else 0
    candidate = Sampling(temperature, top_k, top_p, seed)
    candidate.check()
    if candidate.greedy:
        return GREEDY
    if not request.HasField("seed"):
        candidate = Sampling(temperature, top_k, top_p, secrets.randbelow(MAX_SEED))
    return candidate
