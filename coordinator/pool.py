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

Outlier ejection, in the style of Envoy's outlier detection
(https://www.envoyproxy.io/docs/envoy/latest/intro/arch_overview/upstream/outlier): a replica
that answers its health checks but fails the calls that matter (a grey failure) would come
back on every health poll and fail again. So a replica taken out `EjectionPolicy.after_failures`
times in a row, with no successful round between, is ejected: it gets no rounds, whatever its
health says, for base_s × the number of times it has been ejected (at most max_s), then
returns; each base_s it then spends without a failure forgives one ejection. See
`EjectionPolicy` for the bound on how many may be ejected at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec import metrics
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


@dataclass(frozen=True)
class EjectionPolicy:
    """When a replica that keeps failing is ejected, and for how long (Envoy's consecutive
    failure ejection: consecutive_5xx, base_ejection_time, max_ejection_time and
    max_ejection_percent, whose defaults 5, 30 s and 300 s these follow; the share ejected at
    once defaults to half).

    Invariants: a failure counts when it takes a serving replica out (the calls already in
    flight to it that fail with it are the same failure), and a successful round resets the
    count; an ejection resets it too, so a returning replica needs `after_failures` fresh
    failures to be ejected again. A replica is ejected only if, with it, at most
    `max_percent` of the pool's admitted replicas are ejected, and another replica serves
    (healthy, not ejected): the last serving replica is never ejected, and keeps getting its
    retries."""

    after_failures: int = 5
    """Consecutive failures that eject a replica; 0: never eject."""
    base_s: float = 30.0
    """The first ejection's length; the n-th lasts n × base_s. Also the quiet time (no
    failure, not ejected) that forgives one ejection."""
    max_s: float = 300.0
    """The longest ejection."""
    max_percent: float = 50.0
    """Most replicas of the pool ejected at once, in percent of the admitted ones."""

    def __post_init__(self):
        if self.after_failures < 0:
            raise ValueError(f"--eject-after-failures must be 0 (never) or more, not {self.after_failures}")
        if self.base_s <= 0 or self.max_s < self.base_s:
            raise ValueError(f"ejection times need 0 < --eject-base-s ({self.base_s:g}) <= --eject-max-s "
                             f"({self.max_s:g})")
        if not 0 <= self.max_percent <= 100:
            raise ValueError(f"--max-ejected-percent must be in 0..100, not {self.max_percent:g}")

    def duration(self, ejections: int) -> float:
        """How long the `ejections`-th ejection lasts."""
        return min(self.base_s * ejections, self.max_s)


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    healthy: bool = False  # until its first health check (and admission) passes
    # None until checked by `admit` (again whenever it is out); False: it serves something
    # incompatible, never used.
    admitted: bool | None = None
    sessions: set[str] = field(default_factory=set)
    # Outlier ejection (EjectionPolicy): failures since its last good round, times ejected
    # (less those forgiven), the clock time its ejection ends (None: not ejected), and since
    # when it has been quiet (no failure, not ejected).
    failures: int = 0
    ejections: int = 0
    ejected_until: float | None = None
    quiet_since: float = 0.0

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None

    @property
    def serving(self) -> bool:
        """Whether it may get rounds: healthy, and not ejected."""
        return self.healthy and self.ejected_until is None


class WorkerPool:
    def __init__(self, kind: str, spec: str, service_name: str, channel_options: list,
                 resolve_interval_s: float = 5.0, health_interval_s: float = 1.0,
                 resolver: Resolver = resolve_dns,
                 admit: Callable[[Replica], Awaitable[bool]] | None = None, tls: ClientTLS | None = None,
                 ejection: EjectionPolicy | None = None, clock: Callable[[], float] = time.monotonic):
        self.kind = kind
        self.ejection = ejection or EjectionPolicy()
        self.clock = clock
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
            if replica.ejected:
                metrics.REPLICAS_EJECTED.labels(self.kind).dec()
            await replica.channel.close()

    async def check_health(self) -> None:
        async def check(replica: Replica) -> None:
            if replica.admitted is False:
                return
            if not replica.healthy:  # it may come back restarted, serving other weights: admit it again
                replica.admitted = None
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
                log.info("%s replica %s is %s%s", self.kind, replica.address, "back" if healthy else "out",
                         " (still ejected)" if replica.ejected else "")
                replica.healthy = healthy
                if healthy and not replica.ejected:
                    self.changed.set()

        self.review_ejections()
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
            if replica.ejected:
                metrics.REPLICAS_EJECTED.labels(self.kind).dec()
            await replica.channel.close()
        self.replicas.clear()

    # --- placement ----------------------------------------------------------------------

    def healthy(self) -> list[Replica]:
        """The replicas that may get rounds: healthy and not ejected."""
        self.review_ejections()
        return [r for r in self.replicas.values() if r.serving]

    def replica_for(self, session_id: str, current: str | None) -> Replica | None:
        """The session's replica: where it is, if still serving; else the least loaded."""
        self.review_ejections()
        if current is not None:
            replica = self.replicas.get(current)
            if replica is not None and replica.serving:
                return replica
        candidates = self.healthy()
        if not candidates:
            return None
        chosen = min(candidates, key=lambda r: (len(r.sessions), -_rendezvous(session_id, r.address)))
        chosen.sessions.add(session_id)
        return chosen

    def alternative(self, session_id: str, exclude: str) -> Replica | None:
        """A second serving replica for a round of the session (a hedge,
        coordinator.hedging): the least loaded other than `exclude`, ties broken as in
        placement; the session is not placed on it. None when no other replica serves."""
        candidates = [r for r in self.healthy() if r.address != exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (len(r.sessions), -_rendezvous(session_id, r.address)))

    def mark_failed(self, address: str) -> None:
        """Takes a replica out after a failed call; the health poll brings it back, unless
        this failure ejects it (EjectionPolicy)."""
        replica = self.replicas.get(address)
        if replica is None or not replica.healthy or replica.ejected:
            return  # a call in flight when it was taken out or ejected: the same failure
        replica.healthy = False
        replica.failures += 1
        replica.quiet_since = self.clock()
        policy = self.ejection
        if not policy.after_failures or replica.failures < policy.after_failures:
            log.warning("%s replica %s failed a call: taken out (%d in a row)", self.kind, address, replica.failures)
            return
        refusal = self._ejection_refused(replica)
        if refusal:
            log.warning("%s replica %s failed %d calls in a row: taken out, not ejected (%s)", self.kind, address,
                        replica.failures, refusal)
            return
        replica.ejections += 1
        seconds = policy.duration(replica.ejections)
        replica.ejected_until = self.clock() + seconds
        log.warning("%s replica %s failed %d calls in a row: ejected for %g s (ejection %d)", self.kind, address,
                    replica.failures, seconds, replica.ejections)
        replica.failures = 0
        metrics.REPLICA_EJECTIONS.labels(self.kind).inc()
        metrics.REPLICAS_EJECTED.labels(self.kind).inc()

    def _ejection_refused(self, replica: Replica) -> str:
        """Why ejecting `replica` now would break EjectionPolicy's bounds ("": it would not)."""
        admitted = [r for r in self.replicas.values() if r.admitted is not False]
        ejected = sum(r.ejected for r in admitted)
        if 100 * (ejected + 1) > self.ejection.max_percent * len(admitted):
            return (f"{ejected + 1} of {len(admitted)} replicas would be ejected, over the "
                    f"{self.ejection.max_percent:g}% allowed")
        if not any(r.serving for r in admitted if r is not replica):
            return "no other replica serves"
        return ""

    def succeeded(self, address: str) -> None:
        """A round on the replica got its answer: its consecutive failures start over."""
        replica = self.replicas.get(address)
        if replica is not None:
            replica.failures = 0

    def review_ejections(self) -> None:
        """Returns the replicas whose ejection time has passed, and forgives one ejection per
        EjectionPolicy.base_s a replica has been quiet."""
        now = self.clock()
        for replica in self.replicas.values():
            if replica.ejected_until is not None and now >= replica.ejected_until:
                replica.ejected_until = None
                replica.quiet_since = now
                metrics.REPLICAS_EJECTED.labels(self.kind).dec()
                log.info("%s replica %s returns from ejection%s", self.kind, replica.address,
                         "" if replica.healthy else " (out until its health check passes)")
                if replica.healthy:
                    self.changed.set()
            elif replica.ejected_until is None and replica.ejections:
                forgiven = min(replica.ejections, int((now - replica.quiet_since) // self.ejection.base_s))
                if forgiven:
                    replica.ejections -= forgiven
                    replica.quiet_since += forgiven * self.ejection.base_s

    def forget(self, session_id: str) -> None:
        for replica in self.replicas.values():
            replica.sessions.discard(session_id)
