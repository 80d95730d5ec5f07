"""The replicas of one worker kind, as the coordinator sees them.

Endpoints are a comma-separated list of host:port, where a host may be a DNS name that
resolves to many addresses (a Kubernetes headless Service). Names are re-resolved every
`resolve_interval_s`, so pods that come are used and pods that go are dropped; every replica's
standard health service is polled every `health_interval_s`, so one that fails or reports
NOT_SERVING (draining) gets no new rounds until it is SERVING again.

Placement: a session is placed on the healthy replica with the fewest sessions (ties broken
by rendezvous hashing of session id and address, so placement is stable and spread), and
stays there — its KV cache lives there — until that replica fails, when it moves to another,
which rebuilds the cache from the coordinator's committed tokens (the resync protocol).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.security.tls import ClientTLS, channel

log = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_S = 2.0
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_dns(host: str, port: int) -> list[str]:
    """Every address a name resolves to, as host:port strings (IPv6 bracketed)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = []
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if address not in addresses:
            addresses.append(address)
    return addresses


def parse_endpoints(spec: str) -> list[tuple[str, int]]:
    """'a:1,b:2' -> [('a', 1), ('b', 2)]; raises ValueError naming a bad entry."""
    endpoints = []
    for entry in (part.strip() for part in spec.split(",")):
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"endpoint {entry!r} is not host:port")
        endpoints.append((host.strip("[]"), int(port)))
    if not endpoints:
        raise ValueError("no endpoints given")
    return endpoints


def _rendezvous(session_id: str, address: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session_id}|{address}".encode(), digest_size=8).digest(), "big")


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    healthy: bool = False  # until its first health check (and admission) passes
    # None until checked by `admit`; False: it serves something incompatible, never used.
    admitted: bool | None = None
    sessions: set[str] = field(default_factory=set)


class WorkerPool:
    def __init__(self, kind: str, spec: str, service_name: str, channel_options: list,
                 resolve_interval_s: float = 5.0, health_interval_s: float = 1.0,
                 resolver: Resolver = resolve_dns,
                 admit: Callable[[Replica], Awaitable[bool]] | None = None, tls: ClientTLS | None = None):
        self.kind = kind
        self.endpoints = parse_endpoints(spec)
        self.service_name = service_name
        self.channel_options = channel_options
        self.resolve_interval_s = resolve_interval_s
        self.health_interval_s = health_interval_s
        self.resolver = resolver
        self.tls = tls
        # Checks a new replica before it gets rounds (e.g. that it shares the tokenizer).
        self.admit = admit
        self.replicas: dict[str, Replica] = {}
        # Last successful answer per endpoint: a failed lookup (a DNS hiccup) keeps it.
        self._last_answer: dict[tuple[str, int], list[str]] = {}
        self._tasks: list[asyncio.Task] = []
        self.changed = asyncio.Event()  # set whenever a replica becomes usable

    # --- membership -------------------------------------------------------------------

    async def resolve(self) -> None:
        """Adds replicas for new addresses and drops those no name resolves to any more."""
        seen: list[str] = []
        for host, port in self.endpoints:
            try:
                answer = await self.resolver(host, port)
                self._last_answer[(host, port)] = answer
            except OSError as exc:
                # Either no ready pods or a resolver hiccup: keep what it last resolved to,
                # and let the health checks judge those replicas.
                answer = self._last_answer.get((host, port), [])
                log.warning("%s endpoint %s:%s does not resolve (%s); keeping %d known address(es)",
                            self.kind, host, port, exc, len(answer))
            seen.extend(answer)
        for address in seen:
            if address not in self.replicas:
                log.info("%s replica %s added", self.kind, address)
                self.replicas[address] = Replica(address, channel(address, self.tls, self.channel_options))
                self.changed.set()
        for address in [a for a in self.replicas if a not in seen]:
            log.info("%s replica %s removed (no longer resolves)", self.kind, address)
            replica = self.replicas.pop(address)
            await replica.channel.close()

    async def check_health(self) -> None:
        async def check(replica: Replica) -> None:
            if replica.admitted is False:
                return
            try:
                if replica.admitted is None and self.admit is not None:
                    replica.admitted = await self.admit(replica)
                    if not replica.admitted:
                        log.error("%s replica %s refused: it serves an incompatible model", self.kind,
                                  replica.address)
                        replica.healthy = False
                        return
                reply = await health_pb2_grpc.HealthStub(replica.channel).Check(
                    health_pb2.HealthCheckRequest(service=self.service_name), timeout=HEALTH_CHECK_TIMEOUT_S)
                healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
            except (grpc.aio.AioRpcError, grpc.aio.BaseError):  # failed call, or a channel resolve() closed
                healthy = False
            if healthy != replica.healthy:
                log.info("%s replica %s is %s", self.kind, replica.address, "back" if healthy else "out")
                replica.healthy = healthy
                if healthy:
                    self.changed.set()

        await asyncio.gather(*(check(r) for r in list(self.replicas.values())))

    async def start(self) -> None:
        await self.resolve()
        await self.check_health()
        self._tasks = [asyncio.create_task(self._every(self.resolve_interval_s, self.resolve)),
                       asyncio.create_task(self._every(self.health_interval_s, self.check_health))]

    async def _every(self, interval: float, action: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await action()
            except Exception:  # noqa: BLE001 - a background loop must outlive one bad pass
                log.exception("%s pool maintenance failed", self.kind)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for replica in self.replicas.values():
            await replica.channel.close()
        self.replicas.clear()

    # --- placement ----------------------------------------------------------------------

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def replica_for(self, session_id: str, current: str | None) -> Replica | None:
        """The session's replica: where it is, if still healthy; else the least loaded."""
        if current is not None:
            replica = self.replicas.get(current)
            if replica is not None and replica.healthy:
                return replica
        candidates = self.healthy()
        if not candidates:
            return None
        chosen = min(candidates, key=lambda r: (len(r.sessions), -_rendezvous(session_id, r.address)))
        chosen.sessions.add(session_id)
        return chosen

    def mark_failed(self, address: str) -> None:
        """Takes a replica out after a failed call; the health poll brings it back."""
        replica = self.replicas.get(address)
        if replica is not None and replica.healthy:
            log.warning("%s replica %s failed a call: taken out", self.kind, address)
            replica.healthy = False

    def forget(self, session_id: str) -> None:
        for replica in self.replicas.values():
            replica.sessions.discard(session_id)
