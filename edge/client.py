"""The drafting client: drafts on its own device, has the server verify, keeps going when it cannot.

Online, each cycle is one server call: the draft tree goes up, the accepted path, the next token and the
activations of the newly verified positions come back (``edge/protocol.py``). When a call fails (the
connection drops, is refused, or stays silent past ``call_timeout``) the client rolls its draft back to
the last verified state and continues from the draft alone, emitting those tokens as *unverified*. It
probes the server every ``retry_interval`` seconds; when the server answers, the unverified tokens go up
as one chain, the target accepts their longest correct prefix (lossless, like any draft) and supplies the
next token, and the rest is retracted. If the server lost the session (it restarted), the client opens a
new one with everything verified so far and then verifies the chain. The final text equals the target's
own decoding whenever the server came back; otherwise its tail stays marked unverified.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from specdec_kit.edge import protocol as P
from specdec_kit.edge.drafting import EdgeDrafter
from specdec_kit.runtime.core.sampling import SamplingParams

EventSink = Callable[[str, list[int]], None]  # ("verified" | "unverified" | "confirmed" | "retracted", tokens)


class Offline(ConnectionError):
    """The server could not be reached (or did not answer in time)."""


@dataclass
class EdgeStats:
    calls: int = 0  # request frames sent (OPEN, VERIFY; failed attempts included)
    bytes_up: int = 0  # frame bytes sent, headers included
    bytes_down: int = 0  # frame bytes received (HELLO included)
    prompt_bytes_down: int = 0  # of which HELLO and OPENED (the prompt's activations): paid once per request
    cycles: int = 0  # online draft-verify cycles
    draft_tokens: int = 0
    accepted: int = 0  # accepted draft tokens over online cycles
    outages: int = 0
    offline_tokens: int = 0  # tokens drafted while the server was unreachable
    confirmed: int = 0  # offline tokens the target later accepted
    retracted: int = 0  # offline tokens the target later replaced
    offline_s: float = 0.0
    wall_s: float = 0.0
    generated: int = 0  # tokens in the final output

    @property
    def acceptance_length(self) -> float:
        return (self.accepted + self.cycles) / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0

    def per_token(self, value: float) -> float:
        return value / self.generated if self.generated else 0.0


@dataclass
class EdgeResult:
    tokens: list[int]
    verified: int  # the first ``verified`` tokens are the target's; the rest are the draft's, unverified
    finish_reason: str  # "stop" | "length"
    stats: EdgeStats = field(default_factory=EdgeStats)

    @property
    def unverified_tokens(self) -> list[int]:
        return self.tokens[self.verified :]


class _Connection:
    def __init__(self, host: str, port: int, connect_timeout: float, call_timeout: float, stats: EdgeStats):
        try:
            self.sock = socket.create_connection((host, port), timeout=connect_timeout)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.settimeout(call_timeout)
            kind, body, size = P.recv_frame(self.sock)
        except (OSError, P.ConnectionLost) as exc:
            self.close()
            raise Offline(f"{host}:{port}: {exc}") from exc
        stats.bytes_down += size
        if kind != P.HELLO:
            self.close()
            raise P.ProtocolError(f"{host}:{port}: expected HELLO first, got message type {kind}")
        self.hello = P.Hello.decode(body)

    def call(self, kind: int, body: bytes, stats: EdgeStats):
        data = P.frame(kind, body)
        stats.calls += 1
        try:
            self.sock.sendall(data)
            stats.bytes_up += len(data)
            rkind, rbody, size = P.recv_frame(self.sock)
        except (OSError, P.ConnectionLost) as exc:  # socket.timeout is an OSError
            self.close()
            raise Offline(str(exc) or type(exc).__name__) from exc
        stats.bytes_down += size
        msg = P.decode(rkind, rbody)
        if isinstance(msg, P.Error):
            raise P.Refused(msg.code, msg.message)
        return msg

    def send(self, kind: int, body: bytes, stats: EdgeStats) -> None:
        try:
            data = P.frame(kind, body)
            self.sock.sendall(data)
            stats.bytes_up += len(data)
        except OSError:
            pass

    def close(self) -> None:
        sock = getattr(self, "sock", None)
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
            self.sock = None


class EdgeClient:
    def __init__(
        self,
        host: str,
        port: int,
        drafter: EdgeDrafter,
        *,
        call_timeout: float = 5.0,
        connect_timeout: float = 2.0,
        retry_interval: float = 0.5,
        max_offline_tokens: int = 256,
        reconnect_timeout: float = 30.0,
        act_dtype: str = "float16",
        draft_digest: str | None = None,
    ):
        self.host, self.port, self.drafter = host, port, drafter
        self.call_timeout, self.connect_timeout = call_timeout, connect_timeout
        self.retry_interval, self.max_offline_tokens = retry_interval, max_offline_tokens
        self.reconnect_timeout, self.act_dtype, self.draft_digest = reconnect_timeout, act_dtype, draft_digest
        self.conn: _Connection | None = None

    # -- connection --------------------------------------------------------------------------------
    def _check(self, hello: P.Hello) -> None:
        """Refuse a server whose activations do not fit this client's draft (names what differs)."""
        where = f"server {self.host}:{self.port}"
        if hello.version != P.VERSION:
            raise ValueError(f"{where}: protocol version {hello.version}, this client speaks {P.VERSION}")
        sources = hello.info.get("sources", {})
        src = self.drafter.source
        if src not in sources:
            raise ValueError(f"{where}: no activation source {src!r}; it serves {sorted(sources)}")
        expected = getattr(self.drafter, "tli", None)
        if expected is not None and sources[src].get("tli") != expected:
            raise ValueError(
                f"{where}: source {src!r} sends K/V for TLI = {sources[src].get('tli')}, this draft has TLI = {expected}"
            )
        digest = sources[src].get("weights_sha256")
        if self.draft_digest and digest and digest != self.draft_digest:
            raise ValueError(
                f"{where}: source {src!r} runs the LSA of a different head (weights sha256 {digest[:12]}..., "
                f"this client's {self.draft_digest[:12]}...)"
            )

    def _connect(self, stats: EdgeStats) -> None:
        conn = _Connection(self.host, self.port, self.connect_timeout, self.call_timeout, stats)
        try:
            self._check(conn.hello)
        except ValueError:
            conn.close()
            raise
        self.conn = conn

    def _call(self, kind: int, body: bytes, stats: EdgeStats):
        """One request; a kept-alive connection that turns out dead is replaced once (calls are repeatable)."""
        fresh = self.conn is None or self.conn.sock is None
        if fresh:
            self._connect(stats)
        try:
            return self.conn.call(kind, body, stats)
        except Offline:
            self.conn = None
            if fresh:
                raise
        self._connect(stats)
        try:
            return self.conn.call(kind, body, stats)
        except Offline:
            self.conn = None
            raise

    # -- generation ----------------------------------------------------------------------------
    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int = 64,
        sampling: SamplingParams = SamplingParams(),
        on_event: EventSink | None = None,
        ignore_eos: bool = False,
    ) -> EdgeResult:
        run = _Run(self, list(prompt), max_new_tokens, sampling, on_event or (lambda kind, toks: None), ignore_eos)
        return run.execute()


class _Run:
    """One generation's state machine (online cycles, offline drafting, resynchronisation)."""

    def __init__(self, client: EdgeClient, prompt, max_new, sampling, emit: EventSink, ignore_eos: bool):
        self.c, self.prompt, self.max_new, self.sampling, self.emit = client, prompt, max_new, sampling, emit
        self.ignore_eos = ignore_eos
        self.stats = EdgeStats()
        self.verified: list[int] = []
        self.unverified: list[int] = []
        self.session: int | None = None
        self.eos: set[int] = set()
        self.resync_mark = None
        self.finish: str | None = None

    # -- bookkeeping ---------------------------------------------------------------------------
    def _cut(self, tokens: list[int], room: int) -> tuple[list[int], str | None]:
        """``tokens`` up to EOS (kept) or ``room`` tokens; with the finish reason if one applies."""
        out: list[int] = []
        for tok in tokens:
            if len(out) >= room:
                return out, "length"
            out.append(tok)
            if tok in self.eos and not self.ignore_eos:
                return out, "stop"
        return out, ("length" if len(out) >= room else None)

    def _add_verified(self, tokens: list[int]) -> None:
        kept, finish = self._cut(tokens, self.max_new - len(self.verified))
        self.verified += kept
        self.emit("verified", kept)
        self.finish = finish

    def _offline_done(self) -> bool:
        total = self.verified + self.unverified
        return len(total) >= self.max_new or (
            not self.ignore_eos and bool(self.unverified) and self.unverified[-1] in self.eos
        )

    # -- server calls --------------------------------------------------------------------------
    def _base(self) -> int:
        """The root's position: the server's committed length as this client knows it."""
        return len(self.prompt) + len(self.verified) - 1

    def _open(self, resume: bool) -> None:
        tokens = self.prompt + self.verified if resume else self.prompt
        s = self.sampling
        msg = P.Open(
            self.c.drafter.source,
            tokens,
            self.max_new,
            s.temperature,
            s.top_k,
            s.top_p,
            s.seed,
            resume,
            self.c.act_dtype,
        )
        before = self.stats.bytes_down
        opened: P.Opened = self.c._call(P.OPEN, msg.encode(), self.stats)
        self.stats.prompt_bytes_down += self.stats.bytes_down - before
        self.eos = set(self.c.conn.hello.info.get("eos_token_ids", []))
        self.session = opened.session
        self.c.drafter.start(len(self.prompt) + self.max_new + self.c.conn.hello.info.get("max_tree_nodes", 64) + 8)
        if not resume:
            self.c.drafter.absorb(opened.activations, self.prompt[1:] + [opened.first_token])
            self._add_verified([opened.first_token])
        else:
            self.c.drafter.absorb(opened.activations, tokens[1:])

    def _verify(self, tokens: list[int], parents: list[int]) -> P.Verified:
        """One VERIFY call; if the server lost the session (a restart or expiry), first a new session with
        everything verified so far (the draft state is rebuilt from it and ``resync_mark`` points there)."""
        try:
            return self.c._call(P.VERIFY, P.Verify(self.session, tokens, parents, self._base()).encode(), self.stats)
        except P.Refused as exc:
            if exc.code != P.E_UNKNOWN_SESSION:
                raise
        self._open(resume=True)
        self.resync_mark = self.c.drafter.mark()
        return self.c._call(P.VERIFY, P.Verify(self.session, tokens, parents, self._base()).encode(), self.stats)

    def _cycle(self) -> None:
        d = self.c.drafter
        mark = d.mark()
        self.resync_mark = None
        tree = d.draft()
        tokens, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()
        try:
            reply = self._verify(tokens, parents)
        except Offline:
            d.rollback(self.resync_mark or mark)
            self.resync_mark = None
            raise
        self.resync_mark = None
        accepted = [tokens[i] for i in reply.accepted]
        d.absorb(reply.activations, accepted + [reply.next_token])  # appends when the session was reopened
        st = self.stats
        st.cycles += 1
        st.draft_tokens += len(tokens) - 1
        st.accepted += len(accepted)
        self._add_verified(accepted + [reply.next_token])

    def _retract_all(self) -> None:
        if self.unverified:
            self.stats.retracted += len(self.unverified)
            self.emit("retracted", [len(self.unverified)])
            self.unverified = []

    def _resync(self) -> None:
        """Verify the offline tokens as one chain after the root; keep the accepted prefix, retract the rest."""
        chain = [self.verified[-1]] + self.unverified
        mark = self.resync_mark
        try:
            reply = self._verify(chain, list(range(-1, len(chain) - 1)))
        except Offline:
            if self.resync_mark is not mark:  # reopened, then lost again: the draft restarts from the verified text
                self._retract_all()
            raise
        d = self.c.drafter
        d.rollback(self.resync_mark)
        self.resync_mark = None
        j = len(reply.accepted)
        confirmed = self.unverified[:j]
        self.stats.confirmed += j
        if confirmed:
            self.emit("confirmed", confirmed)
        self.unverified = self.unverified[j:]
        self._retract_all()
        d.absorb(reply.activations, confirmed + [reply.next_token])
        kept, finish = self._cut(confirmed, self.max_new - len(self.verified))
        self.verified += kept
        if finish:
            self.finish = finish
        else:
            self._add_verified([reply.next_token])

    # -- the loop ------------------------------------------------------------------------------
    def execute(self) -> EdgeResult:
        start = time.perf_counter()
        try:
            self._open(resume=False)
        except Offline as exc:
            raise Offline(
                f"cannot start: the server is unreachable ({exc}); a draft needs the prompt's activations"
            ) from exc
        offline_since: float | None = None
        last_probe = 0.0
        while self.finish is None:
            if offline_since is None:
                try:
                    self._cycle() if not self.unverified else self._resync()
                except Offline:
                    offline_since = last_probe = time.perf_counter()
                    self.stats.outages += 1
                    if self.resync_mark is None:
                        self.resync_mark = self.c.drafter.mark()
                continue
            now = time.perf_counter()
            can_draft = (
                self.c.drafter.can_draft_offline
                and not self._offline_done()
                and len(self.unverified) < self.c.max_offline_tokens
            )
            if can_draft:
                tok = self.c.drafter.offline_next()
                self.unverified.append(tok)
                self.stats.offline_tokens += 1
                self.emit("unverified", [tok])
            if now - last_probe >= self.c.retry_interval or not can_draft:
                if not can_draft and now - last_probe < self.c.retry_interval:
                    time.sleep(self.c.retry_interval - (now - last_probe))
                last_probe = time.perf_counter()
                try:
                    self.c._connect(self.stats)
                    self.stats.offline_s += time.perf_counter() - offline_since
                    offline_since = None  # back online: the next turn verifies the offline tokens
                    continue
                except Offline:
                    pass
                if not can_draft and time.perf_counter() - offline_since > self.c.reconnect_timeout:
                    self.stats.offline_s += time.perf_counter() - offline_since
                    break  # give up waiting: the unverified tail stays marked as such
        if self.session is not None and self.c.conn is not None:
            self.c.conn.send(P.CLOSE, P.Close(self.session).encode(), self.stats)
        tokens = self.verified + self.unverified
        finish = self.finish or ("stop" if tokens and tokens[-1] in self.eos and not self.ignore_eos else "length")
        self.stats.generated = len(tokens)
        self.stats.wall_s = time.perf_counter() - start
        return EdgeResult(tokens, len(self.verified), finish, self.stats)
