"""Who may start a request now. Both front doors of the coordinator (gRPC and the
OpenAI-compatible HTTP API) pass through one Admission, so a client's limits are the same
whichever protocol it speaks:

- a per-client request rate (asyncio-throttle): a short wait, then RESOURCE_EXHAUSTED;
- streams served at once, over all clients and per client: RESOURCE_EXHAUSTED at once.

Every refusal carries `retry_after_s`, which each front turns into its protocol's hint
(gRPC trailing metadata, HTTP Retry-After)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from asyncio_throttle import Throttler

from specdec import metrics
from specdec.config import CoordinatorConfig
from specdec.errors import ResourceExhausted

RETRY_AFTER_S = 1
MAX_TRACKED_CLIENTS = 10_000


class Admission:
    def __init__(self, config: CoordinatorConfig):
        self.config = config
        self.active = 0
        self.per_client: dict[str, int] = {}
        self.throttlers: OrderedDict[str, Throttler] = OrderedDict()

    async def enter(self, client: str) -> None:
        """Admits one request of `client` or raises ResourceExhausted; an admitted request
        must call leave() exactly once."""
        await self._throttle(client)
        self._admit(client)

    def leave(self, client: str) -> None:
        self.active -= 1
        self.per_client[client] -= 1
        if not self.per_client[client]:
            del self.per_client[client]

    async def _throttle(self, client: str) -> None:
        rate = self.config.rate_limit_per_client
        if rate <= 0:
            return
        throttler = self.throttlers.get(client)
        if throttler is None:
            throttler = self.throttlers[client] = Throttler(rate_limit=max(1, int(rate)), period=max(1, int(rate)) / rate)
            while len(self.throttlers) > MAX_TRACKED_CLIENTS:
                self.throttlers.popitem(last=False)
        self.throttlers.move_to_end(client)
        try:
            await asyncio.wait_for(throttler.acquire(), timeout=self.config.rate_limit_wait_s)
        except asyncio.TimeoutError:
            retry = max(1, round(1 / rate))
            metrics.REQUESTS.labels("RESOURCE_EXHAUSTED").inc()
            raise ResourceExhausted(f"this client exceeds {rate:g} requests/s; retry in {retry} s",
                                    retry_after_s=retry) from None

    def _admit(self, client: str) -> None:
        if self.active >= self.config.max_concurrent_requests:
            limit = f"the coordinator serves {self.config.max_concurrent_requests} requests at once"
        elif self.per_client.get(client, 0) >= self.config.max_streams_per_client:
            limit = f"this client already holds {self.config.max_streams_per_client} streams"
        else:
            self.active += 1
            self.per_client[client] = self.per_client.get(client, 0) + 1
            return
        metrics.REQUESTS.labels("RESOURCE_EXHAUSTED").inc()
        raise ResourceExhausted(f"{limit}; retry in {RETRY_AFTER_S} s", retry_after_s=RETRY_AFTER_S)
