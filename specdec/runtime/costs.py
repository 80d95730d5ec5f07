"""The measurements that feed the cost model of speculative decoding (specdec.speedup): the
cost c of a draft step and v of a (k + 1)-token verification, both in target steps, timed on
the path the workers serve. The bench reports them; training uses them to rate a draft."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from specdec.runtime.lm import CausalLM
from specdec.ngram import lookup
from specdec.sessions import Session

# Repetitions of each timed forward (interleaved, median taken).
COST_REPEATS = 7


@dataclass(frozen=True)
class StepCosts:
    """Measured seconds at one context length, on the serving path."""

    context: int
    target_step_s: float  # one new token
    verify_s: float  # k + 1 new tokens
    k: int

    @property
    def v(self) -> float:
        return self.verify_s / self.target_step_s


def _timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def measure_target(lm: CausalLM, context: list[int], k: int, repeats: int = COST_REPEATS) -> StepCosts:
    """Times a 1-token step and a (k + 1)-token verification on top of a cache holding
    `context` minus its last token, interleaved so drift hits both alike."""
    session = Session("cost")
    session.cache = lm._new_cache()
    lm.feed(session, context[:-1], logits_to_keep=1)
    base = len(context) - 1
    block = context[-1:] * (k + 1)  # any ids will do: the cost depends on the shape only
    steps, verifies = [], []
    for _ in range(repeats):
        steps.append(_timed(lambda: lm.feed(session, block[:1], logits_to_keep=1)))
        lm.crop(session, base)
        verifies.append(_timed(lambda: lm.feed(session, block, logits_to_keep=k + 1)))
        lm.crop(session, base)
    return StepCosts(len(context), statistics.median(steps), statistics.median(verifies), k)


def measure_draft_model(lm: CausalLM, context: list[int], repeats: int = COST_REPEATS) -> float:
    """Seconds of one draft-model step (1 token on a cache of `context`)."""
    return measure_target(lm, context, 1, repeats).target_step_s


def measure_head(head, context: list[int], repeats: int = COST_REPEATS) -> float:
    """Seconds of one step of a feature-level head (specdec.eagle): 1 position on a cache
    of `context`, then its draft-vocabulary logits and argmax, as the draft worker runs it."""
    cache = head.new_cache()
    hidden = head.config.hidden_size
    head.extend(cache, torch.zeros(len(context), hidden), context)

    def step() -> None:
        out = head.extend(cache, torch.zeros(1, hidden), context[-1:])
        int(torch.argmax(head.logits(out[0])))
        cache.crop(len(context))

    step()  # warm-up
    return statistics.median(_timed(step) for _ in range(repeats))


def measure_ngram(context: list[int], k: int, repeats: int = COST_REPEATS * 3) -> float:
    """Seconds of one n-gram lookup proposing up to k tokens (the whole block at once)."""
    return statistics.median(_timed(lambda: lookup(context, k)) for _ in range(repeats))

