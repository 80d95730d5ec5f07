"""Grey failures, coordinator side. A replica that passes its health checks but fails its
rounds is ejected for a while, longer each time, never beyond the share of replicas allowed
and never the last one serving (coordinator.pool.EjectionPolicy); the worker channels'
keepalive ends a call cut off by a silent network partition in seconds, not at its deadline
(coordinator.workers.channel_options), and the workers permit those pings
(specdec.serving). Real servers on loopback hosts and tiny models; the faults are injected in
a worker's model calls, or by a TCP proxy that stops forwarding."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from coordinator.pool import EjectionPolicy, Replica, WorkerPool, resolve_dns
from coordinator.workers import channel_options
from specdec.client import make_request
from specdec.errors import Unavailable
from specdec.v1 import coordinator_pb2_grpc
from tests.harness import reference_greedy, run, running_cluster, running_stack, start_target
from tests.test_services import PROMPTS, chat_ids, other_draft, target, tokenizer  # noqa: F401 (fixtures)

HOSTS = ["127.0.0.2", "127.0.0.3"]
MAX_NEW = 32


@pytest.fixture(scope="module")
def draft(other_draft):
    return other_draft


@pytest.fixture(scope="module")
def expected(target, tokenizer):
    return {p: reference_greedy(target, chat_ids(tokenizer, p), MAX_NEW) for p in PROMPTS}


def sample(name: str, role: str) -> float:
    return REGISTRY.get_sample_value(name, {"role": role}) or 0.0


# --- the policy, on a pool of replicas that are never called ---------------------------------


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pool_of(count: int, clock: Clock, **policy) -> WorkerPool:
    """A pool of `count` healthy, admitted replicas, its metrics under their own role."""
    addresses = [f"10.0.0.{i + 1}:1" for i in range(count)]
    pool = WorkerPool("policy-test", ",".join(addresses), "unused", [], ejection=EjectionPolicy(**policy), clock=clock)
    for address in addresses:
        pool.replicas[address] = Replica(address, channel=None, healthy=True, admitted=True)
    return pool


def fail(pool: WorkerPool, address: str) -> None:
    """One failed call, after a health poll found the replica SERVING again."""
    pool.replicas[address].healthy = True
    pool.mark_failed(address)


def test_ejections_last_base_times_their_count_up_to_the_maximum():
    clock = Clock()
    pool = pool_of(2, clock, after_failures=1, base_s=10.0, max_s=25.0, max_percent=50.0)
    a = "10.0.0.1:1"
    lengths = []
    for _ in range(3):
        fail(pool, a)
        replica = pool.replicas[a]
        assert replica.ejected and a not in [r.address for r in pool.healthy()]
        lengths.append(replica.ejected_until - clock.now)
        clock.now = replica.ejected_until - 0.001
        assert pool.replicas[a].ejected
        clock.now += 0.001
        pool.review_ejections()
        assert not replica.ejected
    assert lengths == [10.0, 20.0, 25.0]


def test_a_healthy_replica_stays_out_while_ejected():
    clock = Clock()
    pool = pool_of(2, clock, after_failures=1, base_s=10.0, max_s=10.0)
    a = "10.0.0.1:1"
    fail(pool, a)
    pool.replicas[a].healthy = True  # its health check says SERVING
    clock.now += 5.0
    assert [r.address for r in pool.healthy()] == ["10.0.0.2:1"]
    assert pool.replica_for("s", a).address == "10.0.0.2:1"
    clock.now += 5.0
    assert a in [r.address for r in pool.healthy()]


def test_a_successful_round_starts_the_count_over():
    clock = Clock()
    pool = pool_of(2, clock, after_failures=3, base_s=10.0, max_s=10.0)
    a = "10.0.0.1:1"
    fail(pool, a)
    fail(pool, a)
    pool.succeeded(a)
    fail(pool, a)
    fail(pool, a)
    assert not pool.replicas[a].ejected
    fail(pool, a)
    assert pool.replicas[a].ejected


def test_calls_failing_while_a_replica_is_out_are_one_failure():
    clock = Clock()
    pool = pool_of(2, clock, after_failures=2, base_s=10.0, max_s=10.0)
    a = "10.0.0.1:1"
    fail(pool, a)
    pool.mark_failed(a)  # in flight when it was taken out
    pool.mark_failed(a)
    assert pool.replicas[a].failures == 1 and not pool.replicas[a].ejected


def test_a_quiet_replica_is_forgiven_one_ejection_per_base_time():
    clock = Clock()
    pool = pool_of(2, clock, after_failures=1, base_s=10.0, max_s=100.0)
    a = "10.0.0.1:1"
    replica = pool.replicas[a]
    for _ in range(3):
        fail(pool, a)
        clock.now = replica.ejected_until
        pool.review_ejections()
    assert replica.ejections == 3
    clock.now += 9.0
    pool.review_ejections()
    assert replica.ejections == 3
    clock.now += 1.0
    pool.review_ejections()
    assert replica.ejections == 2
    fail(pool, a)  # a failure: not quiet any more
    assert replica.ejected and replica.ejected_until - clock.now == 30.0


def test_at_most_max_percent_of_the_replicas_are_ejected():
    clock = Clock()
    pool = pool_of(4, clock, after_failures=1, base_s=10.0, max_s=10.0, max_percent=50.0)
    for address in list(pool.replicas):
        fail(pool, address)
    assert sum(r.ejected for r in pool.replicas.values()) == 2


def test_the_last_serving_replica_is_never_ejected():
    clock = Clock()
    pool = pool_of(2, clock, after_failures=1, base_s=10.0, max_s=10.0, max_percent=100.0)
    pool.replicas["10.0.0.2:1"].healthy = False  # down
    fail(pool, "10.0.0.1:1")
    assert not pool.replicas["10.0.0.1:1"].ejected
    single = pool_of(1, clock, after_failures=1, base_s=10.0, max_s=10.0, max_percent=100.0)
    for _ in range(5):
        fail(single, "10.0.0.1:1")
    assert not single.replicas["10.0.0.1:1"].ejected


def test_the_ejected_gauge_follows_ejections_and_returns():
    clock = Clock()
    pool = pool_of(2, clock, after_failures=1, base_s=10.0, max_s=10.0)
    counted, ejected = (sample("specdec_replica_ejections_total", "policy-test"),
                        sample("specdec_replicas_ejected", "policy-test"))  # other tests' pools count too
    fail(pool, "10.0.0.1:1")
    assert sample("specdec_replicas_ejected", "policy-test") == ejected + 1
    assert sample("specdec_replica_ejections_total", "policy-test") == counted + 1
    clock.now += 10.0
    pool.review_ejections()
    assert sample("specdec_replicas_ejected", "policy-test") == ejected


@pytest.mark.parametrize("policy", [{"after_failures": -1}, {"base_s": 0.0}, {"base_s": 10.0, "max_s": 5.0},
                                    {"max_percent": 150.0}])
def test_impossible_policies_are_refused(policy):
    with pytest.raises(ValueError):
        EjectionPolicy(**policy)


# --- through the services ---------------------------------------------------------------------


class Fault:
    """Fails a target replica's rounds UNAVAILABLE while `on` (at most `budget` of them when
    given), its health staying SERVING: a grey failure. Records when each step reached it."""

    def __init__(self, servicer, on: bool = False, budget: int | None = None, delay_s: float = 0.0):
        """delay_s: how long a failing step takes."""
        self.on = on
        self.budget = budget
        self.failed = 0
        self.calls: list[float] = []
        verify = servicer.verifier.verify_batch

        def faulty(rounds):
            self.calls.append(time.monotonic())
            if self.on and (self.budget is None or self.failed < self.budget):
                self.failed += 1
                time.sleep(delay_s)
                raise Unavailable("injected fault")
            return verify(rounds)

        servicer.verifier.verify_batch = faulty


async def generate(address: str, prompt: str) -> list[int]:
    """One request's tokens, straight from the coordinator's stream."""
    async with grpc.aio.insecure_channel(address) as channel:
        ids: list[int] = []
        async for response in coordinator_pb2_grpc.CoordinatorStub(channel).Generate(
                make_request(prompt, max_new_tokens=MAX_NEW, k=3), timeout=60):
            ids.extend(response.token_ids)
        return ids


async def until(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s")
        await asyncio.sleep(0.02)


class Watch:
    """Samples a pool every 20 ms: the spans `address` was ejected, whether its health said
    SERVING during one, and the most replicas (and the gauge's most) ejected at once."""

    def __init__(self, pool: WorkerPool, address: str | None = None):
        self.pool = pool
        self.address = address
        self.spans: list[list] = []  # [ejected at, returned at or None]
        self.healthy_while_ejected = False
        self.most_ejected = 0
        self.most_gauge = 0.0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.pool.review_ejections()
            now = time.monotonic()
            self.most_ejected = max(self.most_ejected, sum(r.ejected for r in self.pool.replicas.values()))
            self.most_gauge = max(self.most_gauge, sample("specdec_replicas_ejected", self.pool.kind))
            replica = self.pool.replicas.get(self.address) if self.address else None
            if replica is not None:
                ejected_now = bool(self.spans) and self.spans[-1][1] is None
                if replica.ejected and not ejected_now:
                    self.spans.append([now, None])
                elif not replica.ejected and ejected_now:
                    self.spans[-1][1] = now
                self.healthy_while_ejected |= replica.ejected and replica.healthy
            await asyncio.sleep(0.02)

    def ended(self) -> list[tuple[float, float]]:
        return [(began, ended) for began, ended in self.spans if ended is not None]

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


FLAPPING = {"eject_after_failures": 2, "eject_base_s": 2.0, "eject_max_s": 10.0, "max_ejected_percent": 50.0}


@pytest.fixture(scope="module")
def flapping(target, draft, tokenizer):
    """Two target replicas, the first failing every round while its health says SERVING,
    under steady load: (the watch of that replica, its fault, when it last returned, every
    completed (prompt, tokens), the ejections counted)."""
    async def scenario():
        before = sample("specdec_replica_ejections_total", "target")
        async with running_cluster(target, tokenizer, draft, HOSTS, **FLAPPING) as cluster:
            pool = cluster.servicer.runner.target.pool
            server, servicer = cluster.targets[0]
            fault = Fault(servicer, on=True)
            watch = Watch(pool, server.address)
            results: list[tuple[str, list[int]]] = []
            stop = asyncio.Event()

            async def load(i: int) -> None:
                while not stop.is_set():
                    prompt = PROMPTS[i % len(PROMPTS)]
                    results.append((prompt, await generate(cluster.address, prompt)))
                    i += 1

            loads = [asyncio.create_task(load(i)) for i in range(3)]
            try:
                await until(lambda: len(watch.spans) >= 2, 40)  # ejected, back, ejected again
                fault.on = False  # it heals while ejected the second time
                await until(lambda: len(watch.ended()) >= 2, 20)
                returned = watch.ended()[1][1]
                await until(lambda: any(t > returned for t in fault.calls), 10)
                await asyncio.sleep(0.5)
            finally:
                stop.set()
                await asyncio.gather(*loads)
                await watch.stop()
        return watch, fault, returned, results, sample("specdec_replica_ejections_total", "target") - before

    return run(scenario())


def test_a_replica_failing_its_rounds_is_ejected_though_its_health_says_serving(flapping):
    watch, fault, _, _, counted = flapping
    assert len(watch.ended()) >= 2 and counted >= 2
    assert watch.healthy_while_ejected
    for began, ended in watch.ended():
        # The steps already queued to it when it was ejected fail at once, unsent.
        assert not [t for t in fault.calls if began + 0.1 < t < ended - 0.05], "an ejected replica got a round"


def test_its_second_ejection_lasts_longer(flapping):
    watch, _, _, _, _ = flapping
    (a, b), (c, d) = watch.ended()[:2]
    base = FLAPPING["eject_base_s"]
    assert base - 0.1 < b - a < base + 1.0
    assert 2 * base - 0.1 < d - c < 2 * base + 1.0


def test_it_serves_again_once_its_ejection_ends(flapping):
    _, fault, returned, _, _ = flapping
    assert [t for t in fault.calls if t > returned]


def test_output_through_ejections_equals_the_target(flapping, expected):
    _, _, _, results, _ = flapping
    assert results and all(tokens == expected[prompt] for prompt, tokens in results)


def test_ejections_are_in_the_metrics(flapping):
    watch, _, _, _, counted = flapping
    assert counted >= 2
    assert watch.most_gauge == 1
    assert sample("specdec_replicas_ejected", "target") == 0  # its pool is closed


def test_a_step_that_ejects_its_replica_keeps_the_steps_queued_behind_it_unsent(target, draft, tokenizer, expected):
    # One round per step, and a slow failing step: the first rounds of the requests placed on
    # the failing replica queue there as steps of their own behind the first. That step's
    # failure ejects the replica before the batcher sends the next; they go to the other.
    prompts = PROMPTS * 2

    async def scenario():
        async with running_cluster(target, tokenizer, draft, HOSTS, eject_after_failures=1, eject_base_s=30.0,
                                   eject_max_s=30.0, max_ejected_percent=50.0, max_batch_rounds=1) as cluster:
            fault = Fault(cluster.targets[0][1], on=True, delay_s=0.5)
            outputs = await asyncio.gather(*(generate(cluster.address, p) for p in prompts))
            pool = cluster.servicer.runner.target.pool
            return fault.calls, pool.replicas[cluster.targets[0][0].address].ejected, outputs

    calls, ejected, outputs = run(scenario())
    assert ejected and len(calls) == 1
    assert outputs == [expected[p] for p in prompts]


def test_with_two_replicas_failing_at_most_one_is_ejected(target, draft, tokenizer, expected):
    async def scenario():
        async with running_cluster(target, tokenizer, draft, HOSTS, eject_after_failures=1, eject_base_s=30.0,
                                   eject_max_s=30.0, max_ejected_percent=50.0) as cluster:
            pool = cluster.servicer.runner.target.pool
            faults = [Fault(servicer, on=True) for _, servicer in cluster.targets]
            watch = Watch(pool)
            began = time.monotonic()
            while time.monotonic() - began < 3.0:
                outcomes = await asyncio.gather(*(generate(cluster.address, p) for p in PROMPTS[:2]),
                                                return_exceptions=True)
                assert all(isinstance(o, grpc.aio.AioRpcError) for o in outcomes)
            for fault in faults:
                fault.on = False
            await asyncio.sleep(0.5)  # a health poll or two
            healed = await generate(cluster.address, PROMPTS[0])
            await watch.stop()
            return watch.most_ejected, sum(r.ejected for r in pool.replicas.values()), healed

    most, ejected_at_end, healed = run(scenario())
    assert most == 1 and ejected_at_end == 1
    assert healed == expected[PROMPTS[0]]


@pytest.mark.parametrize("percent", [50.0, 100.0])
def test_a_single_replica_is_never_ejected_and_gets_its_retries(target, tokenizer, expected, percent):
    async def scenario():
        before = sample("specdec_replica_ejections_total", "target")
        async with running_stack(target, tokenizer, eject_after_failures=1, eject_base_s=60.0, eject_max_s=60.0,
                                 max_ejected_percent=percent) as stack:
            fault = Fault(stack.target_servicer, on=True, budget=3)
            tokens = await generate(stack.address, PROMPTS[0])
            replica, = stack.coordinator_servicer.runner.target.pool.replicas.values()
            return tokens, fault.failed, replica.ejected, sample("specdec_replica_ejections_total", "target") - before

    tokens, failed, ejected, counted = run(scenario())
    assert failed == 3 and not ejected and counted == 0
    assert tokens == expected[PROMPTS[0]]


# --- keepalive ----------------------------------------------------------------------------------


def test_worker_channels_carry_the_keepalive_options():
    options = dict(channel_options(1 << 20, keepalive_s=10.0, keepalive_timeout_s=5.0))
    assert options["grpc.keepalive_time_ms"] == 10_000 and options["grpc.keepalive_timeout_ms"] == 5_000
    assert options["grpc.http2.ping_timeout_ms"] == 5_000
    assert options["grpc.keepalive_permit_without_calls"] == 1 and options["grpc.http2.max_pings_without_data"] == 0
    assert "grpc.keepalive_time_ms" not in dict(channel_options(1 << 20, keepalive_s=0.0))
    with pytest.raises(ValueError, match="--worker-keepalive-s"):
        channel_options(1 << 20, keepalive_s=0.2)


async def stays_connected(address: str, idle_s: float) -> bool:
    """Whether a channel pinging every second (1 s keepalive timeout) stays READY through
    idle_s seconds without a call: a server that finds the pings too many closes it."""
    async with grpc.aio.insecure_channel(address, options=channel_options(1 << 20, 1.0, 1.0)) as channel:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        began = time.monotonic()
        while time.monotonic() - began < idle_s:
            if channel.get_state() != grpc.ChannelConnectivity.READY:
                return False
            await asyncio.sleep(0.05)
        return True


def test_a_worker_permits_the_keepalive_pings(target, tokenizer):
    async def scenario():
        worker, _ = await start_target(target, tokenizer)
        plain = grpc.aio.server()  # gRPC's defaults: pings at most every 5 min
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), plain)
        port = plain.add_insecure_port("127.0.0.1:0")
        await plain.start()
        try:
            return await asyncio.gather(stays_connected(worker.address, 5.0), stays_connected(f"127.0.0.1:{port}", 5.0))
        finally:
            await worker.stop(grace=0)
            await plain.stop(0)

    worker_kept, plain_kept = run(scenario())
    assert not plain_kept, "the probe cannot tell: a server with gRPC's defaults kept the connection"
    assert worker_kept, "the worker answered the keepalive pings with GOAWAY"


def test_requests_pass_after_an_idle_time_with_keepalive(target, tokenizer, expected):
    async def scenario():
        async with running_stack(target, tokenizer, worker_keepalive_s=1.0, worker_keepalive_timeout_s=1.0) as stack:
            pool = stack.coordinator_servicer.runner.target.pool
            replica, = pool.replicas.values()
            states = set()
            for _ in range(60):
                states.add(replica.channel.get_state())
                await asyncio.sleep(0.05)
            return dict(pool.channel_options), states, await generate(stack.address, PROMPTS[1])

    options, states, tokens = run(scenario())
    assert options["grpc.keepalive_time_ms"] == 1000 and options["grpc.keepalive_timeout_ms"] == 1000
    assert states == {grpc.ChannelConnectivity.READY}
    assert tokens == expected[PROMPTS[1]]


class Partition:
    """A TCP proxy to one address that, once `cut`, forwards nothing in either direction but
    keeps every connection open (new ones too): a silent network partition, as both ends
    see it."""

    def __init__(self, host: str, upstream: str):
        self.host = host
        self.upstream = upstream
        self.cut = False
        self._server = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        return f"{self.host}:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, _, port = self.upstream.rpartition(":")
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        self._writers += [writer, up_writer]
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if not self.cut:
                writer.write(data)
                await writer.drain()
        writer.close()

    async def close(self) -> None:
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()


def test_a_partition_ends_a_call_at_keepalive_not_at_its_deadline(target, draft, tokenizer, expected):
    """A round in flight to a replica whose network goes silent: the keepalive (1 s, 1 s
    timeout) ends the call within seconds, far inside the 30 s worker deadline, and the
    request finishes on the other replica with the target's own output."""
    held = threading.Event()
    go = threading.Event()
    answer: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        return list(answer) if host == "target.specdec.test" else await resolve_dns(host, port)

    async def scenario():
        cut_off, cut_servicer = await start_target(target, tokenizer, host="127.0.0.4")
        partition = Partition("127.0.0.4", cut_off.address)
        answer.append(await partition.start())
        try:
            async with running_cluster(target, tokenizer, draft, ["127.0.0.3"], resolver=resolver,
                                       target_spec="target.specdec.test:1", worker_keepalive_s=1.0,
                                       worker_keepalive_timeout_s=1.0) as cluster:
                answer.append(cluster.targets[0][0].address)
                pool = cluster.servicer.runner.target.pool
                await until(lambda: len(pool.healthy()) == 2, 10)
                verify = cut_servicer.verifier.verify_batch

                def hold(rounds):
                    if not held.is_set():
                        held.set()
                        go.wait(timeout=30)
                    return verify(rounds)

                cut_servicer.verifier.verify_batch = hold
                requests = asyncio.gather(*(generate(cluster.address, p) for p in PROMPTS))
                assert await asyncio.to_thread(held.wait, 30), "no round reached the replica behind the proxy"
                partition.cut = True
                cut_at = time.monotonic()
                go.set()  # its answer goes nowhere
                results = await requests
                return results, time.monotonic() - cut_at
        finally:
            go.set()
            await partition.close()
            await cut_off.stop(grace=0)

    results, seconds = run(scenario())
    assert results == [expected[p] for p in PROMPTS]
    # keepalive 1 s + timeout 1 s, the retry and the rest of the generation; not 30 s.
    assert seconds < 10.0
