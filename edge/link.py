"""A shaped TCP link between client and server: delay, jitter, loss and rate per direction, and outages.

This machine's kernel has no ``netem`` qdisc (``tc qdisc add ... netem`` answers "Specified qdisc kind is
unknown"; ``tbf`` and ``htb`` exist), so delay, jitter and loss are applied here, in a relay on the path,
segment by segment (1448-byte TCP payloads), the way netem treats packets on an interface's egress:

* a segment leaves when the link is free (``rate``: serialisation time = bytes x 8 / rate), arrives
  ``delay`` +/- uniform ``jitter`` later, never before the previous segment (TCP delivers in order);
* a lost segment (probability ``loss``) arrives one retransmission timeout later (Linux's minimum RTO,
  200 ms), which is what a TCP stream sees of a lost packet.

Profiles follow the Mixture of Attentions paper's client-server setup: a ~9 ms ping, 50 Mbit/s base link,
and netem on top: 4G = 20 Mbit/s, 21 +/- 19 ms, 0.1 % loss; 5G = 10 +/- 10 ms, 0.1 % loss. The netem part
(delay, jitter, loss) shapes the uplink, as one netem qdisc on the client's egress would; the rate applies
both ways. ``bench/client_server.py`` runs this relay in front of a server in another network namespace
whose veth pair carries the kernel's ``tbf`` rate limit (``edge/netns.py``); without namespaces the relay
paces the rate itself on loopback.

``cut("reset")`` drops every connection and refuses new ones; ``cut("blackhole")`` keeps them open and
silently discards everything (clients notice by timeout); ``restore()`` ends either. As a program
(``specdec-edge-link``), SIGUSR1 cuts (blackhole), SIGUSR2 restores.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import threading
import time
from dataclasses import dataclass, replace

SEGMENT = 1448
MIN_RTO_S = 0.2


@dataclass(frozen=True)
class Direction:
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    rate_mbit: float | None = None


@dataclass(frozen=True)
class LinkProfile:
    name: str
    up: Direction  # client -> server
    down: Direction  # server -> client

    def without_rate(self) -> "LinkProfile":
        """The same profile for a path whose rate the kernel already limits (tbf on the veth pair)."""
        return replace(self, up=replace(self.up, rate_mbit=None), down=replace(self.down, rate_mbit=None))

    @property
    def rate_mbit(self) -> float | None:
        return self.up.rate_mbit

    def describe(self) -> str:
        u, d = self.up, self.down
        rate = f"{u.rate_mbit:g} Mbit/s" if u.rate_mbit else "unlimited"
        return (
            f"{self.name}: up {u.delay_ms:g} +/- {u.jitter_ms:g} ms, loss {u.loss:.1%}; down {d.delay_ms:g} ms; "
            f"rate {rate}"
        )


BASE_ONE_WAY_MS = 4.5  # the paper's ~9 ms ping between the two cities
PROFILES = {
    "lan": LinkProfile("lan", Direction(), Direction()),
    "5g": LinkProfile("5g", Direction(BASE_ONE_WAY_MS + 10, 10, 0.001, 50.0), Direction(BASE_ONE_WAY_MS, 0, 0, 50.0)),
    "4g": LinkProfile("4g", Direction(BASE_ONE_WAY_MS + 21, 19, 0.001, 20.0), Direction(BASE_ONE_WAY_MS, 0, 0, 20.0)),
}


class _Pipe:
    """One direction of one connection: segments scheduled by the model above, written in order."""

    def __init__(self, direction: Direction, rng: random.Random):
        self.d, self.rng = direction, rng
        self.link_free = 0.0
        self.last_arrival = 0.0

    def schedule(self, now: float, size: int) -> float:
        d = self.d
        leave = max(now, self.link_free) + (size * 8 / (d.rate_mbit * 1e6) if d.rate_mbit else 0.0)
        self.link_free = leave
        arrive = leave + max(0.0, d.delay_ms + self.rng.uniform(-d.jitter_ms, d.jitter_ms)) / 1000.0
        if d.loss and self.rng.random() < d.loss:
            arrive += MIN_RTO_S
        self.last_arrival = max(self.last_arrival, arrive)
        return self.last_arrival


class LinkEmulator:
    """Relay ``listen`` -> ``upstream`` through ``profile``; runs its own event loop in a thread."""

    def __init__(
        self, upstream: tuple[str, int], profile: LinkProfile, listen: tuple[str, int] = ("127.0.0.1", 0), seed: int = 0
    ):
        self.upstream, self.profile, self.listen = upstream, profile, listen
        self.rng = random.Random(seed)
        self.state = "up"  # "up" | "reset" | "blackhole"
        self.loop = asyncio.new_event_loop()
        self.server: asyncio.base_events.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.port = 0
        self._thread: threading.Thread | None = None

    # -- control (thread-safe) -------------------------------------------------------------------
    def start(self) -> int:
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self._listen())
            ready.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="edge-link", daemon=True)
        self._thread.start()
        ready.wait()
        return self.port

    def _in_loop(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def cut(self, mode: str = "reset") -> None:
        if mode not in ("reset", "blackhole"):
            raise ValueError(f"cut mode {mode!r}: expected 'reset' or 'blackhole'")
        self._in_loop(self._cut(mode))

    def restore(self) -> None:
        self._in_loop(self._restore())

    def stop(self) -> None:
        if self._thread is None:
            return
        self._in_loop(self._cut("reset"))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self._thread = None

    # -- inside the loop -----------------------------------------------------------------------
    async def _listen(self) -> None:
        self.server = await asyncio.start_server(self._accept, self.listen[0], self.listen[1] or self.port or 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _cut(self, mode: str) -> None:
        self.state = mode
        if mode == "reset":
            if self.server is not None:
                self.server.close()
                self.server = None
            self._drop_all()

    async def _restore(self) -> None:
        if self.state == "blackhole":
            self._drop_all()  # their streams lost bytes: end them, the clients reconnect
        self.state = "up"
        if self.server is None:
            self.listen = (self.listen[0], self.port)
            await self._listen()

    def _drop_all(self) -> None:
        for w in list(self.writers):
            transport = w.transport
            if transport is not None:
                transport.abort()
        self.writers.clear()

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        if self.state != "up":
            if self.state == "reset":
                c_writer.transport.abort()
            else:
                self.writers.add(c_writer)  # accepted by the kernel, then silence
            return
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            c_writer.transport.abort()
            return
        self.writers.update((c_writer, s_writer))
        await asyncio.gather(
            self._pump(c_reader, s_writer, _Pipe(self.profile.up, self.rng)),
            self._pump(s_reader, c_writer, _Pipe(self.profile.down, self.rng)),
            return_exceptions=True,
        )
        for w in (c_writer, s_writer):
            self.writers.discard(w)
            w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pipe: _Pipe) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if self.state == "up":
                    writer.write(data)
                    await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if self.state != "up":
                    continue
                now = time.monotonic()
                for i in range(0, len(data), SEGMENT):
                    seg = data[i : i + SEGMENT]
                    queue.put_nowait((pipe.schedule(now, len(seg)), seg))
        finally:
            queue.put_nowait((0.0, None))
            await sender
            writer.transport.abort()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="specdec-edge-link",
        description="Relay a TCP port through a shaped link (delay, jitter, loss, rate); "
        "SIGUSR1 cuts the link (blackhole), SIGUSR2 restores it.",
    )
    p.add_argument("--listen", type=_addr, default=("127.0.0.1", 7434), help="HOST:PORT the client connects to")
    p.add_argument("--upstream", type=_addr, required=True, help="HOST:PORT of the edge server")
    p.add_argument("--profile", choices=sorted(PROFILES), default="4g")
    p.add_argument("--no-rate", action="store_true", help="leave the rate to the kernel (tbf on the path)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    profile = PROFILES[args.profile].without_rate() if args.no_rate else PROFILES[args.profile]
    link = LinkEmulator(args.upstream, profile, args.listen, args.seed)
    port = link.start()
    stop = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: link.cut("blackhole"))
    signal.signal(signal.SIGUSR2, lambda *_: link.restore())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(
        f"specdec-edge-link {args.listen[0]}:{port} -> {args.upstream[0]}:{args.upstream[1]} ({profile.describe()})",
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    link.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
