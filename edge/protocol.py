"""The client-server drafting wire format: length-prefixed binary frames, little-endian, no text on the
hot path.

Frame: ``u32 length`` (of what follows) ``u8 type`` then the message body. Token arrays carry their own
width byte (2 for vocabularies up to 65,536, else 4); tree parents (as ``parent + 1``) and accepted node indices take one
byte each below 256, else two. Activations travel as float16 (default), bfloat16, float32, or
int8 with one float16 scale per row (symmetric absmax), each array as ``u8 dtype, u32 rows, u32 cols``
then the data. A 12-node tree goes up in 59 bytes; with 3 accepted tokens of 192-wide float16 features
about 1.2 KB come back (``bench/client_server.py`` reports bytes per token).

Messages (client -> server): OPEN, VERIFY, CLOSE; (server -> client): HELLO (on connect), OPENED,
VERIFIED, ERROR. Every decode error raises ``ProtocolError`` naming the message and the field.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, field

import numpy as np
import torch

VERSION = 1
MAX_FRAME = 64 << 20  # a frame larger than this is refused before it is read

HELLO, OPEN, OPENED, VERIFY, VERIFIED, CLOSE, ERROR = 1, 2, 3, 4, 5, 6, 7
MESSAGE_NAMES = {
    HELLO: "HELLO",
    OPEN: "OPEN",
    OPENED: "OPENED",
    VERIFY: "VERIFY",
    VERIFIED: "VERIFIED",
    CLOSE: "CLOSE",
    ERROR: "ERROR",
}

ACT_DTYPES = {"float16": 1, "bfloat16": 2, "float32": 3, "int8": 4}
_ACT_NAMES = {v: k for k, v in ACT_DTYPES.items()}
NO_TOKEN = 0xFFFFFFFF

# ERROR codes
E_BAD_REQUEST, E_UNKNOWN_SESSION, E_TOO_LARGE, E_INTERNAL = 1, 2, 3, 4


class ProtocolError(ValueError):
    """A frame that does not decode; the message names what was wrong."""


class Refused(RuntimeError):
    """A request the server refuses: raised by the server's handlers, sent as an ERROR frame with ``code``,
    and raised again by the client that receives it."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class ConnectionLost(ConnectionError):
    """The peer closed the connection (or it broke) in the middle of a call."""


# -- primitive readers/writers ----------------------------------------------------------------------
class Reader:
    def __init__(self, data: bytes, what: str):
        self.data, self.pos, self.what = memoryview(data), 0, what

    def take(self, n: int, field_name: str) -> memoryview:
        if self.pos + n > len(self.data):
            raise ProtocolError(
                f"{self.what}: truncated at field {field_name!r} (needs {n} bytes at offset "
                f"{self.pos}, frame has {len(self.data)})"
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, field_name: str):
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self.take(size, field_name))

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"{self.what}: {len(self.data) - self.pos} trailing bytes")


def pack_tokens(tokens: list[int]) -> bytes:
    width = 2 if (not tokens or max(tokens) < 0x10000) else 4
    if tokens and min(tokens) < 0:
        raise ProtocolError(f"token ids must be >= 0, found {min(tokens)}")
    arr = np.asarray(tokens, dtype="<u2" if width == 2 else "<u4")
    return struct.pack("<BI", width, len(tokens)) + arr.tobytes()


def read_tokens(r: Reader, name: str) -> list[int]:
    width, count = r.unpack("BI", name)
    if width not in (2, 4):
        raise ProtocolError(f"{r.what}: field {name!r} has token width {width}, expected 2 or 4")
    raw = r.take(width * count, name)
    return np.frombuffer(raw, dtype="<u2" if width == 2 else "<u4").astype(np.int64).tolist()


def pack_small(values: list[int]) -> bytes:
    """Non-negative integers, one byte each when all are below 256, else two (tree sizes stay < 65,536)."""
    width = 1 if (not values or max(values) < 256) else 2
    if values and (min(values) < 0 or max(values) >= 0x10000):
        raise ProtocolError(f"tree indices must be in [0, 65535], found {min(values)}..{max(values)}")
    return struct.pack("<B", width) + np.asarray(values, dtype="<u1" if width == 1 else "<u2").tobytes()


def read_small(r: Reader, n: int, name: str) -> list[int]:
    (width,) = r.unpack("B", name)
    if width not in (1, 2):
        raise ProtocolError(f"{r.what}: field {name!r} has width {width}, expected 1 or 2")
    raw = r.take(width * n, name)
    return np.frombuffer(raw, dtype="<u1" if width == 1 else "<u2").astype(np.int64).tolist()


def pack_activation(x: torch.Tensor, dtype: str) -> bytes:
    """[rows, cols] -> bytes in ``dtype`` (see module docstring)."""
    x = x.detach().reshape(x.shape[0], -1).float().cpu()
    rows, cols = x.shape
    head = struct.pack("<BII", ACT_DTYPES[dtype], rows, cols)
    if dtype == "float16":
        return head + x.half().numpy().astype("<f2").tobytes()
    if dtype == "float32":
        return head + x.numpy().astype("<f4").tobytes()
    if dtype == "bfloat16":
        return head + x.bfloat16().view(torch.int16).numpy().astype("<i2").tobytes()
    scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    q = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
    return head + scale.half().numpy().astype("<f2").tobytes() + q.numpy().tobytes()


def read_activation(r: Reader, name: str) -> torch.Tensor:
    code, rows, cols = r.unpack("BII", name)
    if code not in _ACT_NAMES:
        raise ProtocolError(
            f"{r.what}: activation {name!r} has dtype code {code}, expected one of {sorted(_ACT_NAMES)}"
        )
    dtype, n = _ACT_NAMES[code], rows * cols
    if dtype == "float16":
        arr = np.frombuffer(r.take(2 * n, name), dtype="<f2").astype(np.float32)
    elif dtype == "float32":
        arr = np.frombuffer(r.take(4 * n, name), dtype="<f4").copy()
    elif dtype == "bfloat16":
        raw = np.frombuffer(r.take(2 * n, name), dtype="<i2").copy()
        return torch.from_numpy(raw).view(torch.bfloat16).float().view(rows, cols)
    else:
        scale = np.frombuffer(r.take(2 * rows, name), dtype="<f2").astype(np.float32)
        q = np.frombuffer(r.take(n, name), dtype=np.int8).astype(np.float32).reshape(rows, cols)
        return torch.from_numpy(q * scale[:, None])
    return torch.from_numpy(arr).view(rows, cols)


def pack_str(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<H", len(raw)) + raw


def read_str(r: Reader, name: str) -> str:
    (n,) = r.unpack("H", name)
    try:
        return bytes(r.take(n, name)).decode()
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"{r.what}: field {name!r} is not UTF-8 ({exc})") from exc


# -- messages -------------------------------------------------------------------------------------
@dataclass
class Hello:
    """What the server offers: protocol version, the target's identity, and per activation source the
    arrays it sends for each verified position (``{"moa": {"kind": "moa", "widths": [192, 128], ...}}``)."""

    version: int
    info: dict

    def encode(self) -> bytes:
        return struct.pack("<H", self.version) + pack_str(json.dumps(self.info, sort_keys=True))

    @classmethod
    def decode(cls, body: bytes) -> "Hello":
        r = Reader(body, "HELLO")
        (version,) = r.unpack("H", "version")
        text = read_str(r, "info")
        r.end()
        try:
            return cls(version, json.loads(text))
        except json.JSONDecodeError as exc:
            raise ProtocolError(f"HELLO: field 'info' is not JSON ({exc})") from exc


@dataclass
class Open:
    """Start (or, with ``resume``, restart after the server lost it) a sequence. ``tokens`` is the prompt;
    with ``resume`` it is prompt + every verified token, the last of which is the next tree's root."""

    source: str
    tokens: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    resume: bool = False
    act_dtype: str = "float16"

    def encode(self) -> bytes:
        flags = int(self.resume) | (2 if self.seed is not None else 0)
        return (
            pack_str(self.source)
            + struct.pack(
                "<BBIfIfq",
                flags,
                ACT_DTYPES[self.act_dtype],
                self.max_new_tokens,
                self.temperature,
                self.top_k,
                self.top_p,
                self.seed or 0,
            )
            + pack_tokens(self.tokens)
        )

    @classmethod
    def decode(cls, body: bytes) -> "Open":
        r = Reader(body, "OPEN")
        source = read_str(r, "source")
        flags, act, max_new, temp, top_k, top_p, seed = r.unpack("BBIfIfq", "settings")
        if act not in _ACT_NAMES:
            raise ProtocolError(f"OPEN: activation dtype code {act}, expected one of {sorted(_ACT_NAMES)}")
        tokens = read_tokens(r, "tokens")
        r.end()
        return cls(
            source, tokens, max_new, temp, top_k, top_p, seed if flags & 2 else None, bool(flags & 1), _ACT_NAMES[act]
        )


@dataclass
class Opened:
    session: int
    first_token: int | None  # None when resuming (the root is the last resumed token)
    activations: list[torch.Tensor] = field(default_factory=list)  # per array: [positions, width]

    def encode(self, act_dtype: str) -> bytes:
        tok = NO_TOKEN if self.first_token is None else self.first_token
        return struct.pack("<QIB", self.session, tok, len(self.activations)) + b"".join(
            pack_activation(a, act_dtype) for a in self.activations
        )

    @classmethod
    def decode(cls, body: bytes) -> "Opened":
        r = Reader(body, "OPENED")
        session, tok, n = r.unpack("QIB", "header")
        acts = [read_activation(r, f"activation {i}") for i in range(n)]
        r.end()
        return cls(session, None if tok == NO_TOKEN else tok, acts)


@dataclass
class Verify:
    """A draft tree: ``tokens[0]`` is the root (the last verified token), ``parents[0] == -1``. ``base`` is
    the root's position (the client's verified length): a server that committed a verification whose
    answer never arrived rolls back to it, so a repeated call is safe."""

    session: int
    tokens: list[int]
    parents: list[int]
    base: int = 0

    def encode(self) -> bytes:
        if len(self.tokens) != len(self.parents):
            raise ProtocolError(f"VERIFY: {len(self.tokens)} tokens but {len(self.parents)} parents")
        return (
            struct.pack("<QI", self.session, self.base)
            + pack_tokens(self.tokens)
            + pack_small([p + 1 for p in self.parents])
        )

    @classmethod
    def decode(cls, body: bytes) -> "Verify":
        r = Reader(body, "VERIFY")
        session, base = r.unpack("QI", "session")
        tokens = read_tokens(r, "tokens")
        parents = [p - 1 for p in read_small(r, len(tokens), "parents")]
        r.end()
        return cls(session, tokens, parents, base)


@dataclass
class Verified:
    """The accepted path as tree node indices (root excluded), the next token (correction or bonus), and
    the activations of the newly verified positions (the root and the accepted nodes)."""

    accepted: list[int]
    next_token: int
    activations: list[torch.Tensor] = field(default_factory=list)

    def encode(self, act_dtype: str) -> bytes:
        return (
            struct.pack("<H", len(self.accepted))
            + pack_small(self.accepted)
            + struct.pack("<IB", self.next_token, len(self.activations))
            + b"".join(pack_activation(a, act_dtype) for a in self.activations)
        )

    @classmethod
    def decode(cls, body: bytes) -> "Verified":
        r = Reader(body, "VERIFIED")
        (n,) = r.unpack("H", "accepted count")
        accepted = read_small(r, n, "accepted")
        tok, count = r.unpack("IB", "next token")
        acts = [read_activation(r, f"activation {i}") for i in range(count)]
        r.end()
        return cls(accepted, tok, acts)


@dataclass
class Close:
    session: int

    def encode(self) -> bytes:
        return struct.pack("<Q", self.session)

    @classmethod
    def decode(cls, body: bytes) -> "Close":
        r = Reader(body, "CLOSE")
        (session,) = r.unpack("Q", "session")
        r.end()
        return cls(session)


@dataclass
class Error:
    code: int
    message: str

    def encode(self) -> bytes:
        return struct.pack("<H", self.code) + pack_str(self.message[:4000])

    @classmethod
    def decode(cls, body: bytes) -> "Error":
        r = Reader(body, "ERROR")
        (code,) = r.unpack("H", "code")
        msg = read_str(r, "message")
        r.end()
        return cls(code, msg)


DECODERS = {
    HELLO: Hello.decode,
    OPEN: Open.decode,
    OPENED: Opened.decode,
    VERIFY: Verify.decode,
    VERIFIED: Verified.decode,
    CLOSE: Close.decode,
    ERROR: Error.decode,
}


# -- framing --------------------------------------------------------------------------------------
def frame(kind: int, body: bytes) -> bytes:
    return struct.pack("<IB", len(body) + 1, kind) + body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionLost("connection closed by the peer")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> tuple[int, bytes, int]:
    """-> (message type, body, bytes read off the wire)."""
    (length,) = struct.unpack("<I", _recv_exact(sock, 4))
    if length < 1 or length > MAX_FRAME:
        raise ProtocolError(f"frame length {length}: expected 1..{MAX_FRAME}")
    data = _recv_exact(sock, length)
    return data[0], data[1:], length + 4


def decode(kind: int, body: bytes):
    if kind not in DECODERS:
        raise ProtocolError(f"unknown message type {kind}; expected one of {sorted(MESSAGE_NAMES)}")
    return DECODERS[kind](body)
