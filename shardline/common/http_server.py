"""An HTTP API's server (the router's OpenAI-compatible API, the gateway's): uvicorn on the
service's own event loop (a router's engine, admission and gRPC server run there too), with TLS
from the service's certificate flags. Its socket is bound when the service starts, so a port in
use stops it at once with a message. The service owns the signals: uvicorn installs no handlers
of its own, and is told to stop after the drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn

log = logging.getLogger("shardline.http")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the router's SIGTERM drains both front ends
        yield


class HttpServer:
    def __init__(self, app, host: str, port: int, ssl_context: ssl.SSLContext | None = None):
        try:
            self.socket = socket.create_server(
                (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, reuse_port=False, backlog=2048
            )
        except OSError as e:
            raise SystemExit(f"the HTTP API cannot listen on {host}:{port}: {e.strerror}") from None
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=30,
        )
        config.load()
        config.ssl = ssl_context
        self.server, self._task = _Server(config), None
        self.address = f"{'https' if ssl_context else 'http'}://{host}:{port}"

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self.server.serve(sockets=[self.socket]))
        while not self.server.started and not self._task.done():
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """After the drain: open streams have ended; idle connections close."""
        if self._task is None:
            self.socket.close()
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self._task, 10)
        except Exception as e:  # noqa: BLE001 - exiting anyway
            log.warning("the HTTP server did not stop cleanly: %r", e)
