"""What every specdec gRPC server has: the error-mapping interceptor, the standard health
service, reflection, message-size limits, and a clean stop (health NOT_SERVING first, then
in-flight calls get a grace period, then the server stops)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.config import ServerConfig
from specdec.errors import ErrorMappingInterceptor
from specdec.security.tls import check_plaintext_allowed

log = logging.getLogger(__name__)
T = TypeVar("T")


class ModelThread:
    """One thread that runs all model work of a worker, in arrival order. The event loop
    stays free for health checks and new calls while a forward pass runs, and session
    state is only ever touched from this thread, so it needs no locks."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs fn on the model thread and waits for it: for start-up work (loading the
        model), so that one thread does all of a worker's torch work. torch's OpenMP
        runtime (libgomp) gives every thread that runs parallel work its own pool of
        workers, and once a process holds more of them than there are cores it stops
        spinning between parallel regions, and every step on the model thread gets markedly
        slower (figures in benchmarks/results/NOTES.md)."""
        return self._pool.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        # Carry the caller's context (its request id, for logs) into the model thread.
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._pool, context.run, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: list[str]
    config: ServerConfig
    on_stop: Callable[[], None] | None = None
    # Servers of the same service on other protocols (the coordinator's HTTP API), each with
    # `async stop(grace)`: they drain together with this one.
    companions: list = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def stop(self, grace: float | None = None) -> None:
        """Health goes NOT_SERVING, in-flight calls finish (up to `grace` s), then stop."""
        grace = self.config.grace_period_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        await asyncio.gather(self.server.stop(grace), *(c.stop(grace) for c in self.companions))
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
    await server.start()
    for name in ["", *service_names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, health_servicer, port, service_names, config, on_stop)


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
