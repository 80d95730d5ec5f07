"""specdec as users run it: `specdec up` in its own process (coordinator, draft and target
workers, the worker links over mTLS), driven through the real gRPC client."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from specdec.client import Client, make_request

STARTUP_TIMEOUT_S = 600.0
LISTENING = re.compile(r"^coordinator\s+listening on (\S+)")
HTTP_LISTENING = re.compile(r"^HTTP API\s+\(OpenAI-compatible\) on (\S+)")


@dataclass
class ServiceRun:
    token_ids: list[int]
    wall_s: float
    stats: dict = field(default_factory=dict)


class SpecdecUp:
    """One `specdec up` process serving a target and a drafter ('ngram' or a model)."""

    def __init__(self, target: str, draft: str, k: int, threads: int, loop: asyncio.AbstractEventLoop,
                 extra_args: list[str] | None = None, http_port: int = 0, cwd: str | None = None):
        """http_port: serve the OpenAI-compatible HTTP API there too (its base URL in
        self.http_url); 0: no HTTP API. cwd: run it from that source tree (another checkout
        of this repository: its packages are imported, not this one's)."""
        self.draft = draft
        self.k = k
        self.loop = loop
        self.http_url: str | None = None
        self._want_http = bool(http_port)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        command = [sys.executable, "-m", "specdec", "up", "--port", "0", "--http-port", str(http_port),
                   "--target", target, "--draft", draft, "--k", str(k), *(extra_args or [])]
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        cwd=cwd)
        self._stderr: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self.address = self._wait_listening()
        self.client = loop.run_until_complete(self._connect())

    async def _connect(self) -> Client:
        return Client(self.address)  # grpc.aio binds a channel to the loop it is made on

    def _drain_stderr(self) -> None:
        for line in self.process.stderr:
            self._stderr = (self._stderr + [line])[-50:]

    def _wait_listening(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        lines = []
        address = None
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            lines.append(line)
            found, http = LISTENING.match(line), HTTP_LISTENING.match(line)
            address = found.group(1) if found else address
            if http:
                self.http_url = http.group(1)
            if address and (self.http_url or not self._want_http):
                # Nothing else is read from stdout; let it drain so the pipe never fills.
                threading.Thread(target=self.process.stdout.read, daemon=True).start()
                return address
        self.process.kill()
        raise RuntimeError(f"specdec up --draft {self.draft} did not start: {''.join(lines)}{''.join(self._stderr)}")

    @property
    def pid(self) -> int:
        return self.process.pid

    def generate(self, prompt_ids: list[int], max_new_tokens: int, speculate: bool) -> ServiceRun:
        request = make_request(prompt_ids, max_new_tokens=max_new_tokens, k=self.k, speculate=speculate)
        result = self.loop.run_until_complete(self.client.complete(request, wait_for_ready=True))
        return ServiceRun(result.token_ids, result.wall_s, dict(result.stats))

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.client.close())
        finally:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
