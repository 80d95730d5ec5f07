"""uvicorn embedded in the coordinator's event loop: the HTTP API shares the process, the
loop and the servicer with gRPC (no second hop). The socket is bound before anything
starts, so a busy port fails the start with a message naming the flag; signals stay with
the coordinator (specdec.serving.stop_on_signals), which stops this server when it drains."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn

from specdec.config import ServerConfig
from specdec.security.tls import check_plaintext_allowed

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 10.0


class _Embedded(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the coordinator owns SIGTERM and SIGINT


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: a free port); ValueError naming --http-port when
    the port is taken."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--http-port {port}: a port is 0..65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"--http-port {port}: cannot listen on {host}:{port} ({exc.strerror}); "
                         "pick another port, or --http-port 0 to serve no HTTP API") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class HttpServer:
    """The HTTP API's server: start() once, stop(grace) drains in-flight requests."""

    def __init__(self, app, server: ServerConfig, sock: socket.socket):
        """sock: bound by bind(), before the slow parts of start-up."""
        self.app = app
        self.host = server.host
        self.socket = sock
        self.port = self.socket.getsockname()[1]
        options = {}
        if server.tls.enabled:
            options = dict(ssl_certfile=str(server.tls.cert), ssl_keyfile=str(server.tls.key))
            if server.tls.client_ca:
                options.update(ssl_ca_certs=str(server.tls.client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
        else:
            check_plaintext_allowed(server.host, server.insecure, "the HTTP API")
        self.config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", loop="none", ws="none",
                                     timeout_graceful_shutdown=int(max(1, server.grace_period_s)), **options)
        self.server = _Embedded(self.config)
        self.task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        scheme = "https" if self.config.ssl_certfile else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    async def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.socket]))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise OSError(f"the HTTP API on {self.address} stopped while starting")
            if loop.time() > deadline:
                raise OSError(f"the HTTP API on {self.address} did not start in {STARTUP_TIMEOUT_S:g} s")
            await asyncio.sleep(0.01)

    async def stop(self, grace: float) -> None:
        """/health answers 503 and new completions are refused at once; requests in flight
        get `grace` seconds, then the server stops."""
        self.app.state.draining = True
        if self.task is None:
            return
        self.server.config.timeout_graceful_shutdown = grace
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.socket.close()
