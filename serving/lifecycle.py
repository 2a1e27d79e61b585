"""The server process around the app: its listening socket, and graceful shutdown for Kubernetes.

The listening socket fixes each connection's kernel send buffer (``SEND_BUFFER_BYTES``; accepted
connections inherit it, which turns off the kernel's autotuning up to megabytes): a client that stops
reading then pushes back on its own stream within a few hundred tokens, where the scheduler's unread
limit stops it, instead of the kernel absorbing its whole output.

SIGTERM drains instead of closing the listener.

uvicorn's own SIGTERM handling closes the listening socket at once (new requests see "connection
refused") and re-raises the signal after its shutdown (exit status 143). ``DrainingServer`` keeps
listening: from the first SIGTERM, new work gets 503 with ``Retry-After`` and ``/health/ready``
turns false (the Service stops routing here), running and queued requests finish, and the process
exits with status 0 once they have, or after the drain timeout, cancelling what is left. A second
SIGTERM, or SIGINT, shuts down at once.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from types import FrameType

import uvicorn

from specdec_kit.serving.scheduler import Scheduler

logger = logging.getLogger("specdec_kit.serving")

SEND_BUFFER_BYTES = 64 * 1024  # the kernel doubles it; hundreds of tokens of SSE frames


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket (IPv4 or IPv6, as ``host`` resolves) whose connections get a fixed send buffer."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    sock.bind(address)
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, drain_timeout: float):
        super().__init__(config)
        self.scheduler, self.drain_timeout = scheduler, drain_timeout
        self.drain_requested = False
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.drain_requested:
            self.drain_requested = True  # acted on in the event loop (on_tick), not in the signal handler
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.drain_timeout
            self.scheduler.begin_drain()
            logger.info(
                "SIGTERM: draining (new requests get 503; up to %.0f s for %d running or queued)",
                self.drain_timeout,
                self.scheduler.busy(),
            )
        if self.drain_deadline is not None and not self.should_exit:
            busy = self.scheduler.busy()
            if busy and time.monotonic() >= self.drain_deadline:
                logger.warning("drain timeout: cancelling %d unfinished requests", busy)
                self.scheduler.cancel_all()
                self.should_exit = True
            elif not busy:
                logger.info("drained; shutting down")
                self.should_exit = True
        return await super().on_tick(counter)
