"""What every specdec gRPC server has: the error-mapping interceptor, the standard health
service, reflection, message-size limits, and a clean stop (health NOT_SERVING first, then
in-flight calls get a grace period, then the server stops); and what a worker adds to it
(`start_worker_upkeep`): idle sessions expire, and health follows the model thread."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec import metrics
from specdec.config import ServerConfig
from specdec.errors import ErrorMappingInterceptor, Unavailable
from specdec.security.tls import check_plaintext_allowed

log = logging.getLogger(__name__)
T = TypeVar("T")

# How often a server lets a client ping it on a connection with no data (gRPC keepalive);
# pings more often than this are "too many pings" and end the connection with GOAWAY. The
# coordinator's --worker-keepalive-s is at least twice this (coordinator.workers), so pings
# sent on time and delayed a little on the way never count against it.
MIN_PING_INTERVAL_S = 0.5


class ModelThread:
    """One thread that runs all model work of a worker, in arrival order. The event loop
    stays free for health checks and new calls while a forward pass runs, and session
    state is only ever touched from this thread, so it needs no locks.

    It also keeps what a watchdog needs to tell a busy thread from a wedged one: how much
    work is queued or running (`pending`) and how long the thread has had work without
    finishing any (`busy_for`). Once the watchdog calls `stall`, every awaited `run` fails
    UNAVAILABLE at once instead of waiting behind the wedged step (the caller retries on
    another replica; a call that never ran is dropped from the queue) until `recover`."""

    def __init__(self, name: str):
        self.name = name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._pending = 0
        # When a step last finished, or work last arrived at an idle thread (monotonic).
        self._since = time.monotonic()
        # None: not watched; pending while the thread makes progress; resolved with the
        # reason while it is stalled.
        self._stall: asyncio.Future | None = None
        # While watched: each awaited call's answer (on the event loop) and its work.
        self._waiting: dict[asyncio.Future, Future] = {}

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future:
        with self._lock:
            if not self._pending:
                self._since = time.monotonic()
            self._pending += 1
        try:
            future = self._pool.submit(fn, *args)
        except BaseException:
            with self._lock:
                self._pending -= 1
            raise
        future.add_done_callback(self._finished)
        return future

    def _finished(self, future: Future) -> None:
        with self._lock:
            self._pending -= 1
            if not future.cancelled():  # a call dropped from the queue is no progress
                self._since = time.monotonic()

    @property
    def pending(self) -> int:
        """Calls queued for or running on the thread."""
        with self._lock:
            return self._pending

    def busy_for(self) -> float:
        """Seconds the thread has had work without finishing a step; 0 when it has none."""
        with self._lock:
            return time.monotonic() - self._since if self._pending else 0.0

    def watch(self) -> None:
        """Lets `stall` fail awaited calls; call it on the event loop that awaits them."""
        self._stall = asyncio.get_running_loop().create_future()

    @property
    def stalled(self) -> bool:
        return self._stall is not None and self._stall.done()

    def stall(self, reason: str) -> None:
        """Every call awaited now or later fails UNAVAILABLE with `reason` until `recover`."""
        if self._stall is None or self._stall.done():
            return
        self._stall.set_result(reason)
        for answer, work in list(self._waiting.items()):
            work.cancel()  # dropped if still queued; a running step finishes unheard
            if not answer.done():
                answer.set_exception(Unavailable(reason))

    def recover(self) -> None:
        if self.stalled:
            self._stall = self._stall.get_loop().create_future()

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs fn on the model thread and waits for it: for start-up work (loading the
        model), so that one thread does all of a worker's torch work. torch's OpenMP
        runtime (libgomp) gives every thread that runs parallel work its own pool of
        workers, and once a process holds more of them than there are cores it stops
        spinning between parallel regions, and every step on the model thread gets markedly
        slower (figures in benchmarks/results/NOTES.md)."""
        return self._submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        stall = self._stall
        if stall is not None and stall.done():
            raise Unavailable(stall.result())
        # Carry the caller's context (its request id, for logs) into the model thread.
        context = contextvars.copy_context()
        work = self._submit(context.run, fn, *args)
        if stall is None:
            return await asyncio.wrap_future(work)
        # An answer of our own rather than wrap_future's, so that `stall` can fail it.
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        work.add_done_callback(lambda done: _answer_threadsafe(loop, done, answer))
        self._waiting[answer] = work
        try:
            return await answer
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            del self._waiting[answer]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def step_and_observe(step: Callable[[list], T], rounds: list, kind: str, store) -> T:
    """A worker's batched step and its cache gauges, in one trip to the model thread (the
    store belongs to that thread): each hop between the event loop and the thread costs a
    wake-up on both sides, per step."""
    evictions = store.evictions
    outcome = step(rounds)
    metrics.observe_store(kind, store, evictions)
    return outcome


def _answer_threadsafe(loop: asyncio.AbstractEventLoop, done: Future, answer: asyncio.Future) -> None:
    try:
        loop.call_soon_threadsafe(_answer, done, answer)
    except RuntimeError:  # the event loop is closed: nobody waits for the answer
        pass


def _answer(done: Future, answer: asyncio.Future) -> None:
    if answer.done():  # failed by a stall, or its caller was cancelled
        return
    if done.cancelled():
        answer.cancel()
    elif done.exception() is not None:
        answer.set_exception(done.exception())
    else:
        answer.set_result(done.result())


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: list[str]
    config: ServerConfig
    on_stop: Callable[[], None] | None = None
    # What drains together with this one, each with `async stop(grace)`: servers of the same
    # service on other protocols (the coordinator's HTTP API), and long-lived streams that must
    # end within the grace (the coordinator's Generate streams, a worker's step streams).
    companions: list = field(default_factory=list)
    # The plaintext listener of the health service alone (ServerConfig.health_port), and its port.
    health_server: grpc.aio.Server | None = None
    health_port: int | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Health goes NOT_SERVING, in-flight calls finish (up to `grace` s), then stop."""
        grace = self.config.grace_period_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        await asyncio.gather(self.server.stop(grace), *(c.stop(grace) for c in self.companions))
        if self.health_server is not None:  # after the drain: probes see NOT_SERVING during it
            await self.health_server.stop(0)
        if self.on_stop is not None:
            self.on_stop()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def start_server(
    config: ServerConfig,
    register: Callable[[grpc.aio.Server], None],
    service_names: list[str],
    on_stop: Callable[[], None] | None = None,
    interceptors: list | None = None,
) -> RunningServer:
    """Builds, binds and starts a server; `register` adds the service's servicers.
    `interceptors` run before the error-mapping one (e.g. authentication)."""
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
        # Permit the coordinator's keepalive pings (coordinator.workers.channel_options),
        # idle connections included; gRPC's defaults answer pings more often than every 5
        # min with GOAWAY too_many_pings.
        ("grpc.http2.min_ping_interval_without_data_ms", round(MIN_PING_INTERVAL_S * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    server = grpc.aio.server(interceptors=[*(interceptors or []), ErrorMappingInterceptor()], options=options)
    register(server)
    # The asyncio servicer: the sync one's Check is not awaitable under grpc.aio.
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    address = f"{config.host}:{config.port}"
    if config.tls.enabled:
        port = server.add_secure_port(address, config.tls.credentials())
    else:
        check_plaintext_allowed(config.host, config.insecure, "/".join(service_names))
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {config.host}:{config.port}")
    health_server = health_port = None
    if config.health_port is not None:
        health_server, health_port = _health_only_server(config, health_servicer)
    await server.start()
    if health_server is not None:
        await health_server.start()
        log.info("health service alone, in plaintext for probes, on %s:%d", config.host, health_port)
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, health_servicer, port, service_names, config, on_stop,
                         health_server=health_server, health_port=health_port)


def _health_only_server(config: ServerConfig, servicer: health.aio.HealthServicer) -> tuple[grpc.aio.Server, int]:
    """A plaintext listener of the health service alone, answering from the main server's
    `servicer` (so draining and the worker watchdog show there too): for probes that cannot
    speak TLS, such as the kubelet's gRPC probes. It tells a caller only whether the service
    is up; every other method is UNIMPLEMENTED there, so no plaintext reaches the API."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    try:
        port = server.add_insecure_port(f"{config.host}:{config.health_port}")
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"--health-port {config.health_port}: cannot listen on {config.host}:{config.health_port}")
    return server, port


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT. Install it first thing, so a signal that arrives
    while models load still ends the process cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_until(stop: asyncio.Event, servers: list[RunningServer]) -> None:
    """Serves until `stop` is set, then stops the servers one after another, each going
    NOT_SERVING and draining before the next starts: the coordinator first, so that its
    in-flight requests can still reach workers that are SERVING while it drains."""
    await stop.wait()
    log.info("signal received: draining")
    for running in servers:
        await running.stop()


# A session expires between ttl and ttl + one sweep interval after its last round.
MAX_SWEEP_INTERVAL_S = 30.0
# The watchdog looks this often (at most), so a stall is seen within a second of its timeout.
MAX_WATCH_INTERVAL_S = 1.0


def start_worker_upkeep(running: RunningServer, thread: ModelThread, store, kind: str,
                        stall_timeout_s: float) -> None:
    """Starts a worker's background upkeep on the running event loop, stopped with the
    server: a sweep that frees sessions idle for longer than `store.ttl_s`
    (specdec.sessions.SessionStore.expire; none when 0), and a watchdog that turns the
    server's health NOT_SERVING, and fails the calls waiting on the model thread UNAVAILABLE
    (ModelThread.stall), while the thread has work and finishes no step for
    `stall_timeout_s` (none when 0), and SERVING again once a step finishes. Health is
    answered on the event loop, which stays free while the model thread is wedged: without
    the watchdog a wedged worker would report SERVING, and every round sent to it would wait
    for its caller's deadline."""
    tasks = []
    if store.ttl_s > 0:
        tasks.append(asyncio.create_task(_expire_sessions(thread, store, kind)))
    if stall_timeout_s > 0:
        thread.watch()
        tasks.append(asyncio.create_task(_watch_model_thread(running, thread, kind, stall_timeout_s)))
    previous = running.on_stop

    def on_stop() -> None:
        for task in tasks:
            task.cancel()
        if previous is not None:
            previous()

    running.on_stop = on_stop


async def _expire_sessions(thread: ModelThread, store, kind: str) -> None:
    def sweep() -> tuple[int, int]:
        # The store belongs to the model thread: sweep it there, between steps.
        expired = store.expire()
        if expired:
            metrics.observe_store(kind, store, store.evictions)
        return expired, len(store)

    counted = metrics.WORKER_SESSIONS_EXPIRED.labels(kind)  # exported from the start, at 0
    while True:
        await asyncio.sleep(min(store.ttl_s / 4, MAX_SWEEP_INTERVAL_S))
        try:
            expired, left = await thread.run(sweep)
        except Unavailable:
            continue  # a stalled model thread: the watchdog reports it
        if expired:
            counted.inc(expired)
            log.info("%s worker: expired %d session(s) without a round for %g s (%d left)", kind, expired,
                     store.ttl_s, left)


async def _watch_model_thread(running: RunningServer, thread: ModelThread, kind: str, stall_timeout_s: float) -> None:
    names = ["", *running.service_names]
    stalled, stalls = metrics.WORKER_STALLED.labels(kind), metrics.WORKER_STALLS.labels(kind)
    stalled.set(0)
    while True:
        await asyncio.sleep(min(stall_timeout_s / 4, MAX_WATCH_INTERVAL_S))
        busy_s = thread.busy_for()
        if not thread.stalled and busy_s >= stall_timeout_s:
            reason = (f"the {kind} worker's model thread finished no step for {busy_s:.0f} s "
                      f"(--stall-timeout {stall_timeout_s:g} s)")
            thread.stall(reason)
            stalled.set(1)
            stalls.inc()
            log.error("%s worker: model thread stalled: %d call(s) waiting, no step finished for %.1f s; "
                      "health NOT_SERVING, calls refused UNAVAILABLE", kind, thread.pending, busy_s)
            for name in names:
                await running.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        elif thread.stalled and busy_s < stall_timeout_s:
            thread.recover()
            stalled.set(0)
            log.warning("%s worker: model thread finished a step again; health SERVING", kind)
            for name in names:
                await running.health.set(name, health_pb2.HealthCheckResponse.SERVING)
