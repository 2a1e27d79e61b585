"""The verification server of client-server drafting: the target and its KV cache per session.

A client opens a session with its prompt and sampling settings, then sends draft trees; the server runs
each tree through the target, verifies it (greedy or lossless sampling keyed by the session's seed
and token index, ``runtime/core/verify.py``), commits the accepted path and answers with the accepted node indices,
the next token and the activations the client's draft needs (``edge/activations.py``). Sessions outlive
connections (a client that lost its network resumes with the same session id) and expire after
``session_ttl`` idle seconds. Bad frames get an ERROR frame that names the problem; the connection and
the server go on.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec_kit.edge import protocol as P
from specdec_kit.edge.activations import ActivationSource, FeatureSource, MoASource, weights_digest
from specdec_kit.runtime.core.sampling import SamplingParams
from specdec_kit.runtime.core.trees import buffers_from_parents
from specdec_kit.runtime.decoding.drafting import DraftTree, NoDrafter
from specdec_kit.runtime.decoding.generate import DecodeBatch, SpeculativeGenerator
from specdec_kit.runtime.models.target import TargetModel

log = logging.getLogger("specdec.edge.server")


@dataclass
class Session:
    batch: DecodeBatch  # one row: the target's cache and the row's sampling parameters and seed
    source: str
    act_dtype: str
    root: int
    history: list[int] = field(default_factory=list)  # the committed tokens (prompt + accepted), position by position
    last_used: float = field(default_factory=time.monotonic)


class EdgeVerifier:
    """OPEN / VERIFY / CLOSE on a target; transport-free so tests and the network layer share it."""

    def __init__(
        self,
        target: TargetModel,
        sources: dict[str, ActivationSource] | None = None,
        max_tree_nodes: int = 1024,
        session_ttl: float = 600.0,
        max_sessions: int = 64,
    ):
        self.target = target
        self.gen = SpeculativeGenerator(target, NoDrafter())  # the client drafts; the server prefills and verifies
        self.sources = {"none": ActivationSource(), "features": FeatureSource(target.hidden_size), **(sources or {})}
        self.max_tree_nodes, self.session_ttl, self.max_sessions = max_tree_nodes, session_ttl, max_sessions
        self.sessions: dict[int, Session] = {}
        self._next_id = int(time.time() * 1000) << 8  # ids stay unique across server restarts
        self.lock = threading.Lock()

    def hello(self) -> P.Hello:
        t = self.target
        return P.Hello(
            P.VERSION,
            {
                "vocab_size": t.vocab_size,
                "eos_token_ids": t.eos_token_ids(),
                "num_layers": t.num_layers,
                "hidden_size": t.hidden_size,
                "max_context": t.max_context,
                "max_tree_nodes": self.max_tree_nodes,
                "sources": {name: s.describe() for name, s in self.sources.items()},
            },
        )

    def _expire(self) -> None:
        now = time.monotonic()
        for sid in [s for s, v in self.sessions.items() if now - v.last_used > self.session_ttl]:
            del self.sessions[sid]

    def _check_tokens(self, tokens: list[int], what: str) -> None:
        bad = [t for t in tokens if t >= self.target.vocab_size]
        if bad:
            raise P.Refused(
                P.E_BAD_REQUEST, f"{what}: token id {bad[0]} is outside the vocabulary of {self.target.vocab_size}"
            )

    @torch.inference_mode()
    def open(self, msg: P.Open) -> P.Opened:
        self._expire()
        if msg.source not in self.sources:
            raise P.Refused(
                P.E_BAD_REQUEST,
                f"OPEN: activation source {msg.source!r} is not served here; expected one of {sorted(self.sources)}",
            )
        if len(self.sessions) >= self.max_sessions:
            raise P.Refused(P.E_TOO_LARGE, f"OPEN: {self.max_sessions} sessions are open; close one or retry later")
        need = 2 if msg.resume else 1
        if len(msg.tokens) < need:
            raise P.Refused(
                P.E_BAD_REQUEST,
                f"OPEN: {len(msg.tokens)} tokens; {'a resume needs the prompt and the root' if msg.resume else 'the prompt is empty'}",
            )
        self._check_tokens(msg.tokens, "OPEN")
        try:
            params = SamplingParams(msg.temperature, msg.top_k, msg.top_p, msg.seed)
        except ValueError as exc:
            raise P.Refused(P.E_BAD_REQUEST, f"OPEN: {exc}") from exc
        prefix = msg.tokens[:-1] if msg.resume else msg.tokens
        t = self.target
        if len(prefix) + msg.max_new_tokens + 1 > t.max_context:
            raise P.Refused(
                P.E_TOO_LARGE,
                f"OPEN: {len(prefix)} tokens + {msg.max_new_tokens} new exceed the target's context of {t.max_context}",
            )
        # a resumed session's root was chosen before the server lost it: it is the prefill's first token
        batch = self.gen.prefill(
            [prefix],
            [msg.max_new_tokens + 1],
            [params],
            ignore_eos=[True],
            first_tokens=[msg.tokens[-1] if msg.resume else None],
        )
        root = batch.rows[0].tokens[0]
        sid = self._next_id
        self._next_id += 1
        self.sessions[sid] = Session(batch, msg.source, msg.act_dtype, root, list(prefix))
        n = len(prefix)
        acts = self.sources[msg.source](batch.ctx_feats[0, :n], batch.cache, n)
        return P.Opened(sid, None if msg.resume else root, acts)

    def _session(self, sid: int, what: str) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            raise P.Refused(
                P.E_UNKNOWN_SESSION, f"{what}: unknown session {sid} (expired, closed or from before a restart)"
            )
        s.last_used = time.monotonic()
        return s

    @torch.inference_mode()
    def verify(self, msg: P.Verify) -> tuple[P.Verified, str]:
        s = self._session(msg.session, "VERIFY")
        n = len(msg.tokens)
        if n == 0 or n > self.max_tree_nodes:
            raise P.Refused(P.E_TOO_LARGE, f"VERIFY: a tree of {n} nodes; expected 1..{self.max_tree_nodes}")
        self._check_tokens(msg.tokens, "VERIFY")
        length = len(s.history)
        if msg.base < length and msg.base >= 1 and s.history[msg.base] == msg.tokens[0]:
            # an earlier answer was lost on the way: forget what the client never saw
            s.batch.cache.truncate(msg.base)
            del s.history[msg.base :]
            s.root = msg.tokens[0]
        elif msg.base != length:
            raise P.Refused(
                P.E_BAD_REQUEST, f"VERIFY: base position {msg.base}, but the session has {length} committed tokens"
            )
        if msg.tokens[0] != s.root:
            raise P.Refused(
                P.E_BAD_REQUEST, f"VERIFY: the root token is {msg.tokens[0]}, expected the last verified token {s.root}"
            )
        try:
            buffers = buffers_from_parents(msg.parents)
        except ValueError as exc:
            raise P.Refused(P.E_BAD_REQUEST, f"VERIFY: bad tree parents ({exc})") from exc
        t = self.target
        if length + buffers.max_depth + 2 > t.max_context:
            raise P.Refused(P.E_TOO_LARGE, f"VERIFY: the sequence would pass the target's context of {t.max_context}")
        dev = t.device
        tokens = torch.tensor([msg.tokens], dtype=torch.long, device=dev)
        tree = DraftTree(
            tokens,
            buffers.parents.to(dev)[None],
            torch.ones_like(tokens, dtype=torch.bool),
            buffers.tree_mask.to(dev)[None],
            buffers.position_offsets.to(dev)[None],
        )
        result = self.gen.verify_tree(s.batch, tree)
        count = int(result.counts[0])
        path = result.path[0, :count]
        s.history += [msg.tokens[i] for i in path.tolist()]
        s.root = int(result.next_tokens[0])
        acts = self.sources[s.source](result.features[0, :count], s.batch.cache, count)
        return P.Verified(path[1:].tolist(), s.root, acts), s.act_dtype

    def close(self, msg: P.Close) -> None:
        self.sessions.pop(msg.session, None)

    def handle(self, kind: int, body: bytes) -> bytes | None:
        """One request frame's body -> the reply frame (None for CLOSE); errors become ERROR frames."""
        try:
            msg = P.decode(kind, body)
            with self.lock:
                if kind == P.OPEN:
                    opened = self.open(msg)
                    return P.frame(P.OPENED, opened.encode(msg.act_dtype))
                if kind == P.VERIFY:
                    verified, act_dtype = self.verify(msg)
                    return P.frame(P.VERIFIED, verified.encode(act_dtype))
                if kind == P.CLOSE:
                    self.close(msg)
                    return None
            raise P.Refused(P.E_BAD_REQUEST, f"{P.MESSAGE_NAMES.get(kind, kind)} is not a request a client sends")
        except P.ProtocolError as exc:
            return P.frame(P.ERROR, P.Error(P.E_BAD_REQUEST, str(exc)).encode())
        except P.Refused as exc:
            return P.frame(P.ERROR, P.Error(exc.code, str(exc)).encode())
        except Exception as exc:  # a bug must not take the server down: report it, keep serving
            log.exception("request failed")
            return P.frame(P.ERROR, P.Error(P.E_INTERNAL, f"internal error: {type(exc).__name__}: {exc}").encode())


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        verifier: EdgeVerifier = self.server.verifier  # type: ignore[attr-defined]
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.sendall(P.frame(P.HELLO, verifier.hello().encode()))
            while True:
                try:
                    kind, body, _ = P.recv_frame(sock)
                except P.ProtocolError as exc:  # the framing itself is broken: say why, then hang up
                    sock.sendall(P.frame(P.ERROR, P.Error(P.E_BAD_REQUEST, str(exc)).encode()))
                    return
                reply = verifier.handle(kind, body)
                if reply is not None:
                    sock.sendall(reply)
        except (P.ConnectionLost, OSError):
            return


class EdgeServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, verifier: EdgeVerifier, host: str = "127.0.0.1", port: int = 0):
        self.verifier = verifier
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start_background(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="edge-server", daemon=True)
        thread.start()
        return thread


def load_sources(target: TargetModel, heads: list[str]) -> dict[str, ActivationSource]:
    """``NAME=PATH`` per Mixture-of-Attentions head whose LSA this server runs."""
    from specdec_kit.runtime.checkpoint import load_draft

    sources: dict[str, ActivationSource] = {}
    shape = (target.num_layers, 2 * target.num_kv_heads * target.head_dim)
    for spec in heads:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--moa-head {spec!r}: expected NAME=PATH (e.g. moa=zoo/moa)")
        if name in ("none", "features"):
            raise ValueError(f"--moa-head {spec!r}: the name {name!r} is reserved")
        draft = load_draft(
            Path(path),
            "moa",
            target.hidden_size,
            target.vocab_size,
            dtype=target.dtype,
            device=target.device,
            target_shape=shape,
        )
        sources[name] = MoASource(draft, weights_digest(path))
    return sources


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        target = TargetModel.from_pretrained(args.target, dtype=args.dtype, device=args.device)
        sources = load_sources(target, args.moa_head)
    except ValueError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    verifier = EdgeVerifier(target, sources, max_tree_nodes=args.max_tree_nodes, session_ttl=args.session_ttl)
    server = EdgeServer(verifier, args.host, args.port)
    print(
        f"specdec-edge-server listening on {args.host}:{server.port} (sources: {', '.join(verifier.sources)})",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":  # the command line lives in the light module, which runs this one
    from specdec_kit.edge.server_cli import main

    raise SystemExit(main())
