"""Hedged target rounds (coordinator.hedging). A target replica that is slow but not failing
holds the rounds sent to it; with hedging, a round unanswered past the tail of the pool's
latencies also goes to a second replica, the first answer wins, the session lives on where
it was answered, and the slow replica's copy is released. The output stays the target's
own, greedy and seeded; the bounds hold: the budget, a single replica, a spent deadline.
Real servers on loopback hosts and tiny models; the slowness is a worker's model thread held
(tests.test_services.Gate) or slowed, its health SERVING throughout."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from coordinator.hedging import HEDGE_MIN_SAMPLES, HedgePolicy, Hedger, LatencyWindow, round_class
from specdec.client import Client, make_request
from specdec.models import NGRAM
from specdec.v1 import coordinator_pb2_grpc
from tests.factories import make_tiny_model
from tests.harness import reference_greedy, reference_sample, run, running_cluster, running_stack
from tests.test_cli import free_port, model_dirs, specdec  # noqa: F401 (fixture)
from tests.test_services import PROMPTS, Gate, chat_ids, other_draft, target, tokenizer  # noqa: F401 (fixtures)

HOSTS = ["127.0.0.2", "127.0.0.3"]
MAX_NEW = 24
HEDGING = {"hedge_percentile": 95.0, "hedge_factor": 1.0, "hedge_min_s": 0.05, "hedge_max_share": 0.1}
# How long a replica is held at most while the requests run: far longer than hedged requests
# take to finish, and inside the Gate's own 30 s; without hedging, held for HELD_OFF_S.
HELD_S = 10.0
HELD_OFF_S = 3.0
# Sampling as tests/test_sampling_services.py samples, on a flatter model (so there are choices).
SAMPLING = {"temperature": 0.9, "top_k": 40, "top_p": 0.95}
EOS = (2,)


def counted(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def hedge_counts() -> dict[str, float]:
    counts = {o: counted("specdec_hedged_rounds_total", outcome=o) for o in ("won", "lost")}
    counts.update({r: counted("specdec_hedges_skipped_total", reason=r) for r in ("budget", "deadline", "no_replica")})
    return counts


def since(before: dict[str, float]) -> dict[str, float]:
    return {name: value - before[name] for name, value in hedge_counts().items()}


@pytest.fixture(scope="module")
def flat_target(tokenizer):
    model = make_tiny_model(tokenizer, seed=0, layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    return model


# --- the policy alone ------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [{"percentile": -1.0}, {"percentile": 101.0}, {"factor": 0.0},
                                    {"min_s": -0.1}, {"max_share": 1.5}])
def test_impossible_policies_are_refused(policy):
    with pytest.raises(ValueError, match="--hedge-"):
        HedgePolicy(**policy)


def test_hedging_is_off_at_percentile_zero():
    assert not HedgePolicy().enabled and not HedgePolicy(percentile=0.0, max_share=0.5).enabled
    hedger = Hedger(HedgePolicy(percentile=0.0))
    for _ in range(2 * HEDGE_MIN_SAMPLES):
        hedger.observe(1, 0.1)
    assert hedger.delay(1) is None


def test_the_delay_is_the_percentile_times_the_factor_never_below_the_floor():
    hedger = Hedger(HedgePolicy(percentile=95.0, factor=2.0, min_s=0.05))
    for _ in range(HEDGE_MIN_SAMPLES - 1):
        hedger.observe(1, 0.1)
    assert hedger.delay(1) is None, "hedged on too few latencies"
    for _ in range(100 - (HEDGE_MIN_SAMPLES - 1)):
        hedger.observe(1, 0.1)
    hedger.observe(1, 5.0)  # 100 latencies of 0.1 s and one of 5 s: the 95th percentile is 0.1 s
    assert hedger.delay(1) == pytest.approx(0.2)
    floor = Hedger(HedgePolicy(percentile=95.0, factor=1.0, min_s=0.05))
    for _ in range(HEDGE_MIN_SAMPLES):
        floor.observe(1, 0.001)
    assert floor.delay(1) == 0.05


def test_long_rounds_have_their_own_latencies():
    assert round_class(4) == "short" and round_class(1000) == "long"
    hedger = Hedger(HedgePolicy(percentile=50.0, factor=1.0, min_s=0.0))
    for _ in range(HEDGE_MIN_SAMPLES):
        hedger.observe(4, 0.01)
        hedger.observe(1000, 1.0)
    assert hedger.delay(4) == 0.01 and hedger.delay(1000) == 1.0


def test_nearest_rank_percentiles():
    window = LatencyWindow()
    for value in range(1, 11):
        window.observe(float(value))
    assert [window.percentile(p) for p in (10, 50, 95, 100)] == [1.0, 5.0, 10.0, 10.0]


def test_the_budget_bounds_the_share_of_hedged_calls_over_its_window():
    hedger = Hedger(HedgePolicy(percentile=95.0, max_share=0.1), budget_rounds=100)
    granted = []
    for _ in range(1000):
        hedger.count_call()
        granted.append(hedger.grant())  # every call asks for a hedge
    for end in range(100, 1001):
        assert sum(granted[end - 100:end]) <= 10
    assert sum(granted) >= 95  # and the window slides: old hedges make room again
    assert hedger.hedges == sum(granted) and hedger.calls == 1000


# --- through the services --------------------------------------------------------------------------


def greedy_requests(prompts):
    return [make_request(p, max_new_tokens=MAX_NEW, k=3) for p in prompts]


def seeded_requests(prompts):
    return [make_request(p, max_new_tokens=MAX_NEW, k=3, seed=i + 1, **SAMPLING) for i, p in enumerate(prompts)]


@dataclasses.dataclass
class Held:
    """What a run with one target replica held produced."""

    results: list  # Completions, in request order
    finished_while_held: bool  # every request finished while the replica was held
    seconds: float  # how long the requests ran while it was held
    reached: bool  # a round reached the held replica
    counts: dict  # hedge metrics, deltas
    hedge_lines: list[str]  # the coordinator's DEBUG lines about sending a hedge
    sessions_left: int  # sessions the held replica holds after the coordinator drained


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def with_a_replica_held(model, tokenizer, draft, requests, held_s: float = HELD_S, **options) -> Held:
    """Two target replicas; warm-up requests fill the latency windows, then the first
    replica's model thread is held while `requests` run at once, for at most held_s (in
    its batched verification, or with batching off in its one-round verification)."""
    method = "verify_batch" if options.get("batching", True) else "verify"
    logger = logging.getLogger("coordinator.workers")
    lines, level = Lines(), logger.level
    async with running_cluster(model, tokenizer, draft, HOSTS, **options) as cluster:
        _, servicer = cluster.targets[0]
        gate = Gate(getattr(servicer.verifier, method), at_call=0)  # calls count from 1: not yet
        setattr(servicer.verifier, method, gate)
        async with Client(cluster.address) as client:
            warm_up = greedy_requests(PROMPTS * 2)
            await asyncio.gather(*(client.complete(r) for r in warm_up))
            await cluster.servicer.runner.drain()  # sessions released: both replicas start empty
            before = hedge_counts()
            gate.at_call = gate.calls + 1
            logger.addHandler(lines)
            logger.setLevel(logging.DEBUG)
            try:
                began = time.monotonic()
                tasks = [asyncio.create_task(client.complete(r)) for r in requests]
                try:
                    done, _ = await asyncio.wait(tasks, timeout=held_s)
                    seconds = time.monotonic() - began
                finally:
                    gate.release.set()
                results = await asyncio.gather(*tasks)
                await cluster.servicer.runner.drain()
                counts = since(before)
            finally:
                logger.removeHandler(lines)
                logger.setLevel(level)
        return Held(results, len(done) == len(tasks), seconds, gate.entered.is_set(), counts,
                    [line for line in lines.lines if "hedged to" in line], len(servicer.store))


@pytest.fixture(scope="module")
def hedged(target, other_draft, tokenizer):
    return run(with_a_replica_held(target, tokenizer, other_draft, greedy_requests(PROMPTS), **HEDGING))


def test_requests_finish_while_a_replica_holds_their_rounds(hedged):
    assert hedged.reached, "no round reached the held replica: the scenario tests nothing"
    assert hedged.finished_while_held


def test_hedged_output_equals_the_target(hedged, target, tokenizer):
    assert [r.token_ids for r in hedged.results] == [reference_greedy(target, chat_ids(tokenizer, p), MAX_NEW)
                                                     for p in PROMPTS]


def test_hedges_that_won_are_counted_and_logged(hedged):
    assert hedged.counts["won"] >= 1
    assert len(hedged.hedge_lines) == hedged.counts["won"] + hedged.counts["lost"]


def test_the_slow_replicas_copy_of_each_session_is_released(hedged):
    assert hedged.counts["won"] >= 1 and hedged.sessions_left == 0


def test_seeded_sampling_through_hedges_equals_the_target_sampling_alone(flat_target, tokenizer):
    held = run(with_a_replica_held(flat_target, tokenizer, NGRAM, seeded_requests(PROMPTS), **HEDGING))
    assert held.reached and held.finished_while_held and held.counts["won"] >= 1
    for i, (prompt, result) in enumerate(zip(PROMPTS, held.results)):
        expected = reference_sample(flat_target, chat_ids(tokenizer, prompt), MAX_NEW, seed=i + 1, eos_ids=EOS,
                                    **SAMPLING)
        assert result.token_ids == expected, prompt
    assert held.sessions_left == 0


def test_with_batching_off_the_slow_call_itself_is_cancelled(target, other_draft, tokenizer):
    held = run(with_a_replica_held(target, tokenizer, other_draft, greedy_requests(PROMPTS), batching=False,
                                   **HEDGING))
    assert held.reached and held.finished_while_held and held.counts["won"] >= 1
    assert [r.token_ids for r in held.results] == [reference_greedy(target, chat_ids(tokenizer, p), MAX_NEW)
                                                   for p in PROMPTS]
    assert held.sessions_left == 0


def test_without_hedging_the_held_replica_holds_its_requests(target, other_draft, tokenizer):
    off = dict(HEDGING, hedge_percentile=0.0)
    held = run(with_a_replica_held(target, tokenizer, other_draft, greedy_requests(PROMPTS), HELD_OFF_S, **off))
    assert held.reached and not held.finished_while_held
    assert held.counts["won"] == held.counts["lost"] == 0
    assert [r.token_ids for r in held.results] == [reference_greedy(target, chat_ids(tokenizer, p), MAX_NEW)
                                                   for p in PROMPTS]


def slowed(servicer, seconds: float) -> None:
    """Every step of the replica's model thread takes `seconds` longer: slow, not failing."""
    verify = servicer.verifier.verify_batch

    def slow(rounds):
        time.sleep(seconds)
        return verify(rounds)

    servicer.verifier.verify_batch = slow


# Nearly every round is past the 1st percentile: every one would be hedged but for the bounds.
EAGER = {"hedge_percentile": 1.0, "hedge_factor": 1.0, "hedge_min_s": 0.001, "hedge_max_share": 0.1}


def test_the_budget_caps_hedges_when_every_replica_is_slow(target, other_draft, tokenizer):
    async def scenario():
        async with running_cluster(target, tokenizer, other_draft, HOSTS, **EAGER) as cluster:
            for _, servicer in cluster.targets:
                slowed(servicer, 0.05)
            before = hedge_counts()
            async with Client(cluster.address) as client:
                results = await asyncio.gather(*(client.complete(r) for r in greedy_requests(PROMPTS)))
            await cluster.servicer.runner.drain()
            hedger = cluster.servicer.runner.target.hedger
            left = [len(servicer.store) for _, servicer in cluster.targets]
            return results, since(before), hedger.calls, hedger.hedges, left

    results, counts, calls, hedges, left = run(scenario())
    assert counts["budget"] >= 1, "the budget never had to refuse a hedge: the scenario tests nothing"
    assert 1 <= hedges == counts["won"] + counts["lost"]
    assert hedges <= EAGER["hedge_max_share"] * calls
    assert [r.token_ids for r in results] == [reference_greedy(target, chat_ids(tokenizer, p), MAX_NEW)
                                              for p in PROMPTS]
    assert left == [0, 0]


def test_a_single_replica_never_hedges(target, tokenizer):
    async def scenario():
        async with running_stack(target, tokenizer, draft=NGRAM, **EAGER) as stack:
            slowed(stack.target_servicer, 0.02)
            before = hedge_counts()
            async with Client(stack.address) as client:
                results = await asyncio.gather(*(client.complete(r) for r in greedy_requests(PROMPTS)))
            return results, since(before)

    results, counts = run(scenario())
    assert counts["no_replica"] >= 1, "no round was ever due a hedge: the scenario tests nothing"
    assert counts["won"] == counts["lost"] == 0
    assert [r.token_ids for r in results] == [reference_greedy(target, chat_ids(tokenizer, p), MAX_NEW)
                                              for p in PROMPTS]


async def generate(address: str, request, timeout_s: float):
    """One request's tokens, or the error that ended it."""
    async with grpc.aio.insecure_channel(address) as channel:
        ids: list[int] = []
        try:
            async for response in coordinator_pb2_grpc.CoordinatorStub(channel).Generate(request, timeout=timeout_s):
                ids.extend(response.token_ids)
        except grpc.aio.AioRpcError as exc:
            return exc
        return ids


def test_a_request_whose_deadline_is_nearly_spent_is_not_hedged(target, tokenizer):
    """The delay is 1 s (the floor: the factor makes the percentile negligible) and the
    requests' deadline 1.5 s: when a round is due a hedge, less than the delay is left, so
    none is sent and the held request runs out of time (a hedge would have answered it)."""
    async def scenario():
        policy = dict(HEDGING, hedge_factor=0.001, hedge_min_s=1.0)
        async with running_cluster(target, tokenizer, NGRAM, HOSTS, **policy) as cluster:
            _, servicer = cluster.targets[0]
            gate = Gate(servicer.verifier.verify_batch, at_call=0)
            servicer.verifier.verify_batch = gate
            async with Client(cluster.address) as client:
                await asyncio.gather(*(client.complete(r) for r in greedy_requests(PROMPTS * 2)))
            await cluster.servicer.runner.drain()
            before = hedge_counts()
            gate.at_call = gate.calls + 1
            try:
                outcomes = await asyncio.gather(*(generate(cluster.address, r, 1.5)
                                                  for r in greedy_requests(PROMPTS[:2])))
            finally:
                gate.release.set()
            # The client gave up at its deadline; the coordinator ends the request (and queues
            # its sessions' release) at the same deadline, on its own clock.
            waited = time.monotonic()
            while cluster.servicer.active and time.monotonic() - waited < 10.0:
                await asyncio.sleep(0.02)
            await cluster.servicer.runner.drain()
            return gate.entered.is_set(), outcomes, since(before), len(servicer.store)

    reached, outcomes, counts, left = run(scenario())
    assert reached
    assert counts["deadline"] >= 1 and counts["won"] == counts["lost"] == 0
    assert any(isinstance(o, grpc.aio.AioRpcError) and o.code() == grpc.StatusCode.DEADLINE_EXCEEDED
               for o in outcomes)
    assert left == 0


# --- flags -----------------------------------------------------------------------------------------

HEDGE_FIELDS = ("hedge_percentile", "hedge_factor", "hedge_min_s", "hedge_max_share")


@pytest.mark.parametrize("command", [["serve", "coordinator"], ["up"]])
def test_hedge_flags_and_variables_reach_the_coordinator_config(command, monkeypatch):
    from specdec.cli import build_parser, flags
    from specdec.config import CoordinatorConfig

    def config(*argv: str) -> tuple:
        args = build_parser().parse_args([*command, *argv])  # variables are read as the parser is built
        made = flags.coordinator_config(args, "target:1", None, "tokenizer")
        return tuple(getattr(made, name) for name in HEDGE_FIELDS)

    defaults = {f.name: f.default for f in dataclasses.fields(CoordinatorConfig)}
    assert config() == tuple(defaults[name] for name in HEDGE_FIELDS)
    assert config("--hedge-percentile", "95", "--hedge-factor", "1.5", "--hedge-min-s", "0.2",
                  "--hedge-max-share", "0.05") == (95.0, 1.5, 0.2, 0.05)
    for variable, value in (("SPECDEC_HEDGE_PERCENTILE", "99"), ("SPECDEC_HEDGE_FACTOR", "2"),
                            ("SPECDEC_HEDGE_MIN_S", "0.1"), ("SPECDEC_HEDGE_MAX_SHARE", "0.2")):
        monkeypatch.setenv(variable, value)
    assert config() == (99.0, 2.0, 0.1, 0.2)
    assert config("--hedge-percentile", "90")[0] == 90.0  # a flag wins over its variable


def test_an_impossible_hedge_flag_stops_the_coordinator_at_start(model_dirs):
    result = specdec("serve", "coordinator", "--port", "0", "--http-port", "0", "--tokenizer",
                     str(model_dirs["target"]), "--target-addr", f"127.0.0.1:{free_port()}",
                     "--hedge-percentile", "150", timeout=60)
    assert result.returncode == 2
    assert "INVALID_ARGUMENT: --hedge-percentile must be 0 (off) or in (0, 100]" in result.stderr
