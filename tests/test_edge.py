"""Client-server drafting: the draft on a client, the target behind a real TCP server on localhost.

Losslessness over the network (greedy identity with ``transformers``, sampled distributions), the remote
draft equal to the local one, outages (reset and silent), a server that forgot the session, bad frames,
mismatched heads, and a real network path (namespace + veth + kernel rate limit) where root allows.
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time

import pytest
import torch

from specdec_kit.edge import protocol as P
from specdec_kit.edge.activations import weights_digest
from specdec_kit.edge.client import EdgeClient, Offline
from specdec_kit.edge.drafting import make_edge_drafter
from specdec_kit.edge.link import PROFILES, LinkEmulator
from specdec_kit.edge.netns import NetnsLink
from specdec_kit.edge.server import EdgeServer, EdgeVerifier, load_sources
from specdec_kit.runtime.checkpoint import save_draft
from specdec_kit.runtime.core.sampling import SamplingParams
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.decoding.generate import SpeculativeGenerator
from specdec_kit.runtime.loader import make_drafter
from specdec_kit.runtime.synthetic import oracle_eagle, oracle_moa, random_moa

NEW = 32
TREE = DynamicTreeConfig(10, 3, 3)


@pytest.fixture(scope="module")
def edge_setup(predictable_case, tmp_path_factory):
    """The predictable target and its drafts on disk, and a server with the MoA heads' LSA."""
    root = tmp_path_factory.mktemp("edge")
    case = predictable_case
    case.hf.save_pretrained(root / "target")
    drafts = {
        "moa": random_moa(case.target, tli=1),
        "moa_tli0": random_moa(case.target, tli=0, seed=5),
        "moa_oracle": oracle_moa(case.target),
    }
    for name, draft in drafts.items():
        save_draft(draft, root / name, "moa", safetensors=True)
    save_draft(oracle_eagle(case.target), root / "eagle", "eagle2")
    sources = load_sources(case.target, [f"{n}={root / n}" for n in drafts])
    verifier = EdgeVerifier(case.target, sources)
    server = EdgeServer(verifier)
    server.start_background()
    yield dict(case=case, root=root, verifier=verifier, port=server.port)
    server.shutdown()
    server.server_close()


def client_for(setup, name: str, port: int | None = None, **kwargs) -> EdgeClient:
    root = setup["root"]
    kind = "moa" if name.startswith("moa") else name
    path = None if name == "none" else root / name
    drafter = make_edge_drafter(kind, root / "target", path, TREE, source=name if kind == "moa" else None)
    digest = weights_digest(path) if kind == "moa" else None
    return EdgeClient("127.0.0.1", port or setup["port"], drafter, draft_digest=digest, **kwargs)


@pytest.mark.parametrize("name", ["none", "eagle", "moa", "moa_tli0", "moa_oracle"])
def test_greedy_over_the_network_equals_transformers(edge_setup, name):
    case = edge_setup["case"]
    client = client_for(edge_setup, name)
    for prompt, ref in list(zip(case.prompts, case.references))[:3]:
        result = client.generate(prompt, NEW)
        assert result.tokens == ref[:NEW] and result.verified == NEW and result.finish_reason == "length"
        st = result.stats
        assert st.calls == st.cycles + 1  # OPEN + one VERIFY per cycle, nothing else
        if name == "moa_oracle":  # the TLI = L draft is the target itself: every tree is accepted to its depth
            assert st.acceptance_length > 3.0


@pytest.mark.parametrize("name", ["eagle", "moa", "moa_tli0"])
def test_remote_draft_is_the_local_draft(edge_setup, name):
    """With float32 activations the client drafts exactly the trees the in-process drafter drafts."""
    case, root = edge_setup["case"], edge_setup["root"]
    kind = "moa" if name.startswith("moa") else "eagle2"
    local = SpeculativeGenerator(case.target, make_drafter(case.target, kind, root / name, TREE))
    client = client_for(edge_setup, name, act_dtype="float32")
    for prompt in case.prompts[:3]:
        mine = local.generate([prompt], NEW)[0]
        remote = client.generate(prompt, NEW)
        assert remote.tokens == mine.tokens
        assert (remote.stats.cycles, remote.stats.accepted) == (mine.stats.cycles, mine.stats.accepted_tokens)


@pytest.mark.slow
def test_sampling_over_the_network_draws_the_target_distribution(tmp_path):
    from test_sampling_distribution import PROMPT, VOCAB, chi_square_pvalue, exact_distributions

    from specdec_kit.runtime.models.target import TargetModel
    from specdec_kit.runtime.synthetic import tiny_hf_model

    hf = tiny_hf_model(
        hidden_size=32,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=64,
        vocab=VOCAB,
        context_mix=0.6,
        logit_scale=6.0,
        seed=21,
    )
    target = TargetModel(hf)
    hf.save_pretrained(tmp_path / "target")
    save_draft(random_moa(target, tli=1), tmp_path / "moa", "moa", safetensors=True)
    server = EdgeServer(EdgeVerifier(target, load_sources(target, [f"moa={tmp_path / 'moa'}"])))
    server.start_background()
    drafter = make_edge_drafter("moa", tmp_path / "target", tmp_path / "moa", DynamicTreeConfig(10, 3, 3))
    client = EdgeClient("127.0.0.1", server.port, drafter)
    samples, accepted = 1500, 0
    seqs = []
    for i in range(samples):
        r = client.generate(PROMPT, 3, SamplingParams(temperature=1.0, seed=50_000 + i))
        seqs.append(r.tokens)
        accepted += r.stats.accepted
    server.shutdown()
    server.server_close()
    seqs = torch.tensor(seqs)
    joint, marginal3 = exact_distributions(target, SamplingParams(temperature=1.0))
    observed12 = torch.zeros(VOCAB, VOCAB)
    observed12.index_put_((seqs[:, 0], seqs[:, 1]), torch.ones(samples), accumulate=True)
    p12 = chi_square_pvalue(observed12, joint)
    p3 = chi_square_pvalue(torch.bincount(seqs[:, 2], minlength=VOCAB), marginal3)
    assert min(p12, p3) > 1e-3 / 2, f"p-values {p12:.2e}, {p3:.2e}"
    assert 0 < accepted  # drafts were accepted (and, with a random draft, also rejected)


class Outage:
    """Event sink that cuts the link after ``after`` verified tokens and restores it after ``offline``
    unverified ones (never, with None), recording what the client showed."""

    def __init__(self, link: LinkEmulator, after: int, offline: int | None, mode: str = "reset", forget=None):
        self.link, self.after, self.offline, self.mode, self.forget = link, after, offline, mode, forget
        self.verified = self.unverified = 0
        self.cut_done = self.restored = False
        self.events: list[tuple[str, list[int]]] = []

    def __call__(self, kind: str, tokens: list[int]) -> None:
        self.events.append((kind, list(tokens)))
        if kind == "verified":
            self.verified += len(tokens)
            if not self.cut_done and self.verified >= self.after:
                self.cut_done = True
                self.link.cut(self.mode)
                if self.forget:
                    self.forget()
        elif kind == "unverified":
            self.unverified += 1
            if self.offline is not None and not self.restored and self.unverified >= self.offline:
                self.restored = True
                self.link.restore()


@pytest.fixture
def link(edge_setup):
    emu = LinkEmulator(("127.0.0.1", edge_setup["port"]), PROFILES["lan"])
    emu.start()
    yield emu
    emu.stop()


@pytest.mark.parametrize("name,mode", [("moa_oracle", "reset"), ("moa", "reset"), ("eagle", "blackhole")])
def test_outage_keeps_generating_unverified_then_verifies_it(edge_setup, link, name, mode):
    case = edge_setup["case"]
    prompt, ref = case.prompts[0], case.references[0][:NEW]
    client = client_for(edge_setup, name, port=link.port, call_timeout=0.5, retry_interval=0.05)
    sink = Outage(link, after=6, offline=8, mode=mode)
    result = client.generate(prompt, NEW, on_event=sink)
    st = result.stats
    assert sink.cut_done and sink.restored and st.outages >= 1 and st.offline_tokens >= 8
    assert result.tokens == ref and result.verified == NEW  # verified after the server came back: lossless
    assert st.confirmed + st.retracted == st.offline_tokens
    if name == "moa_oracle":  # offline drafting with TLI = L is the target's own decoding: all confirmed
        assert st.retracted == 0 and st.confirmed == st.offline_tokens
    shown: list[int] = []  # replaying the events gives the final text
    pending: list[int] = []
    for kind, toks in sink.events:
        if kind == "verified":
            shown += toks
        elif kind == "unverified":
            pending += toks
        elif kind == "confirmed":
            shown += pending[: len(toks)]
            pending = pending[len(toks) :]
        else:
            pending = pending[: -toks[0]] if toks[0] else pending
    assert shown == result.tokens and not pending


def test_server_gone_for_good_leaves_the_tail_marked_unverified(edge_setup, link):
    case = edge_setup["case"]
    prompt, ref = case.prompts[1], case.references[1][:NEW]
    client = client_for(
        edge_setup,
        "moa_oracle",
        port=link.port,
        call_timeout=0.3,
        retry_interval=0.05,
        reconnect_timeout=0.5,
        max_offline_tokens=12,
    )
    result = client.generate(prompt, NEW, on_event=Outage(link, after=5, offline=None))
    assert 5 <= result.verified < NEW and len(result.unverified_tokens) == 12
    assert result.tokens[: result.verified] == ref[: result.verified]
    assert result.tokens == ref[: len(result.tokens)]  # the oracle's offline text is right, but still marked


def test_server_that_lost_the_session_is_resumed(edge_setup, link):
    case, verifier = edge_setup["case"], edge_setup["verifier"]
    prompt, ref = case.prompts[2], case.references[2][:NEW]
    client = client_for(edge_setup, "moa", port=link.port, call_timeout=0.5, retry_interval=0.05)
    sink = Outage(link, after=7, offline=5, forget=verifier.sessions.clear)  # as after a server restart
    result = client.generate(prompt, NEW, on_event=sink)
    assert result.tokens == ref and result.verified == NEW and result.stats.calls >= result.stats.cycles + 3


def test_start_without_a_server_says_so(edge_setup):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Offline, match="cannot start"):
        client_for(edge_setup, "eagle", port=port, connect_timeout=0.5).generate([1, 2, 3], 4)


def _raw_call(port: int, data: bytes):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        P.recv_frame(sock)  # HELLO
        sock.sendall(data)
        kind, body, _ = P.recv_frame(sock)
        return P.decode(kind, body)


def test_bad_requests_get_errors_and_the_server_keeps_serving(edge_setup):
    port, case = edge_setup["port"], edge_setup["case"]
    prompt = case.prompts[0]
    opened = _raw_call(port, P.frame(P.OPEN, P.Open("moa", prompt, 8).encode()))
    sid, root, base = opened.session, opened.first_token, len(case.prompts[0])
    cases = {
        P.frame(42, b""): "unknown message type 42",
        P.frame(P.VERIFY, struct.pack("<QI", sid, base) + b"\x02"): "VERIFY: truncated at field 'tokens'",
        P.frame(P.VERIFY, P.Verify(sid + 999, [1], [-1], base).encode()): "unknown session",
        P.frame(P.VERIFY, P.Verify(sid, [root + 1 if root < 5 else 1], [-1], base).encode()): "root token is",
        P.frame(P.VERIFY, P.Verify(sid, [root], [-1], base + 3).encode()): "base position",
        P.frame(P.VERIFY, P.Verify(sid, [root, 500], [-1, 0], base).encode()): "outside the vocabulary of 80",
        P.frame(P.VERIFY, P.Verify(sid, [root, 3, 4], [-1, 2, 0], base).encode()): "bad tree parents",
        P.frame(P.OPEN, P.Open("medusa", [1, 2], 8).encode()): "activation source 'medusa' is not served",
        P.frame(P.OPEN, P.Open("none", [1, 2], 10**6).encode()): "exceed the target's context",
    }
    for data, expected in cases.items():
        reply = _raw_call(port, data)
        assert isinstance(reply, P.Error) and expected in reply.message, (expected, reply)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # a broken frame length: error, hang up
        P.recv_frame(sock)
        sock.sendall(struct.pack("<I", P.MAX_FRAME + 1))
        kind, body, _ = P.recv_frame(sock)
        assert kind == P.ERROR and "frame length" in P.Error.decode(body).message
    result = client_for(edge_setup, "moa").generate(case.prompts[0], 8)  # still serving
    assert result.tokens == case.references[0][:8]
    # a VERIFY repeated because its answer was lost: the server rolls back and answers it again
    chain = P.Verify(sid, [root] + case.references[0][1:4], [-1, 0, 1, 2], base)
    first, again = (_raw_call(port, P.frame(P.VERIFY, chain.encode())) for _ in range(2))
    assert isinstance(again, P.Verified) and (again.accepted, again.next_token) == (first.accepted, first.next_token)
    assert again.accepted == [1, 2, 3] and again.next_token == case.references[0][4]


def test_client_refuses_a_server_with_another_head(edge_setup, tmp_path):
    case, root = edge_setup["case"], edge_setup["root"]
    save_draft(random_moa(case.target, tli=1, seed=99), tmp_path / "other", "moa", safetensors=True)
    drafter = make_edge_drafter("moa", root / "target", tmp_path / "other", TREE, source="moa")
    client = EdgeClient("127.0.0.1", edge_setup["port"], drafter, draft_digest=weights_digest(tmp_path / "other"))
    with pytest.raises(ValueError, match="LSA of a different head"):
        client.generate(case.prompts[0], 4)
    drafter = make_edge_drafter("moa", root / "target", root / "moa", TREE, source="moa_tli0")
    with pytest.raises(ValueError, match="TLI = 0, this draft has TLI = 1"):
        EdgeClient("127.0.0.1", edge_setup["port"], drafter).generate(case.prompts[0], 4)


def test_protocol_round_trips_and_names_what_is_wrong():
    x = torch.randn(5, 96) * 3
    for dtype, tol in (("float32", 0.0), ("float16", 2e-3), ("bfloat16", 2e-2), ("int8", 1.5e-2)):
        msg = P.Verified.decode(P.Verified([1, 4, 300], 70_000, [x]).encode(dtype))
        assert msg.accepted == [1, 4, 300] and msg.next_token == 70_000
        err = ((msg.activations[0] - x).abs() / x.abs().amax(dim=1, keepdim=True)).max()
        assert err <= tol, (dtype, float(err))
    v = P.Verify.decode(P.Verify(7, [5, 6, 7], [-1, 0, 1], 99).encode())
    assert (v.session, v.tokens, v.parents, v.base) == (7, [5, 6, 7], [-1, 0, 1], 99)
    o = P.Open.decode(P.Open("moa", [1, 2], 16, 0.7, 5, 0.9, 123, True, "int8").encode())
    assert (o.source, o.tokens, o.seed, o.resume, o.act_dtype, o.top_k) == ("moa", [1, 2], 123, True, "int8", 5)
    assert P.Open.decode(P.Open("x", [1], 4).encode()).seed is None
    # a tree of 8 nodes with 16-bit tokens: 12 (session, base) + 5 + 16 (tokens) + 1 + 8 (parents) + 5 (frame)
    assert len(P.frame(P.VERIFY, P.Verify(1, list(range(8)), [-1] + list(range(7))).encode())) == 47
    with pytest.raises(P.ProtocolError, match="OPENED: truncated at field 'activation 0'"):
        P.Opened.decode(P.Opened(1, 2, [x]).encode("float16")[:-3])
    with pytest.raises(P.ProtocolError, match="trailing bytes"):
        P.Close.decode(b"\x00" * 9)


def test_link_profile_delays_and_paces(edge_setup):
    """The relay's model: 4G adds ~30 ms per round trip and paces 20 Mbit/s (side by side with the LAN)."""
    port = edge_setup["port"]
    times = {}
    for name in ("lan", "4g"):
        emu = LinkEmulator(("127.0.0.1", port), PROFILES[name], seed=3)
        emu.start()
        rtts = []
        with socket.create_connection(("127.0.0.1", emu.port), timeout=5) as sock:
            P.recv_frame(sock)
            for _ in range(5):
                t0 = time.perf_counter()
                sock.sendall(P.frame(P.CLOSE, P.Close(1).encode()) + P.frame(P.OPEN, P.Open("zzz", [1], 1).encode()))
                P.recv_frame(sock)
                rtts.append(time.perf_counter() - t0)
        emu.stop()
        times[name] = sorted(rtts)[2]
    assert times["4g"] - times["lan"] > 0.015  # one-way 25.5 +/- 19 ms up, 4.5 ms down


def test_real_network_path_with_kernel_rate_limit(edge_setup):
    ok, why = NetnsLink.available()
    if not ok:
        pytest.skip(why)
    case, root = edge_setup["case"], edge_setup["root"]
    with NetnsLink("specdec-test", rate_mbit=20) as ns:
        server = subprocess.Popen(
            ns.exec_prefix
            + [
                sys.executable,
                "-m",
                "specdec_kit.edge.server",
                "--target",
                str(root / "target"),
                "--moa-head",
                f"moa={root / 'moa'}",
                "--host",
                ns.server_ip,
                "--port",
                "7433",
                "--threads",
                "1",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            lines = [server.stdout.readline() for _ in range(1)]
            while "listening" not in lines[-1] and lines[-1] and len(lines) < 50:  # past loading progress bars
                lines.append(server.stdout.readline())
            assert "listening" in lines[-1], "".join(lines)
            before = ns.wire_bytes()
            drafter = make_edge_drafter("moa", root / "target", root / "moa", TREE, source="moa")
            emu = LinkEmulator((ns.server_ip, 7433), PROFILES["5g"].without_rate())
            emu.start()
            result = EdgeClient("127.0.0.1", emu.port, drafter).generate(case.prompts[0], NEW)
            emu.stop()
            sent, received = (a - b for a, b in zip(ns.wire_bytes(), before))
        finally:
            server.terminate()
            server.wait(timeout=10)
    assert result.tokens == case.references[0][:NEW]
    assert sent > result.stats.bytes_up and received > result.stats.bytes_down  # TCP/IP headers and ACKs on top


@pytest.mark.slow
def test_generate_cli_prints_verified_text(demo_checkpoints):
    from specdec_kit.runtime.loader import load_tokenizer
    from specdec_kit.runtime.models.target import TargetModel

    target = TargetModel.from_pretrained(demo_checkpoints["target"])
    server = EdgeServer(EdgeVerifier(target))
    server.start_background()
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "specdec_kit.edge.cli",
                "--server",
                f"127.0.0.1:{server.port}",
                "--target",
                str(demo_checkpoints["target"]),
                "--draft",
                "griffin",
                "--draft-path",
                str(demo_checkpoints["griffin"]),
                "--prompt",
                "Hello, world",
                "--max-new-tokens",
                "24",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        bad = subprocess.run(
            [
                sys.executable,
                "-m",
                "specdec_kit.edge.cli",
                "--server",
                "nohost",
                "--target",
                str(demo_checkpoints["target"]),
                "--prompt",
                "x",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    tok = load_tokenizer(demo_checkpoints["target"])
    ids = tok("Hello, world")["input_ids"]
    expected = SpeculativeGenerator(target).generate([ids], 24)[0].tokens
    assert record["verified_text"] == tok.decode(expected) and record["unverified_text"] == ""
    assert record["stats"]["verified"] == 24 and record["stats"]["server_calls"] < 24
    assert bad.returncode == 2 and "expected HOST:PORT" in bad.stderr


@pytest.mark.slow
def test_benchmark_smoke_on_loopback(tmp_path):
    """The benchmark end to end on the committed zoo (loopback path, 2 prompts x 16 tokens, 5G, an outage)."""
    from specdec_kit.bench.client_server_cli import main as bench_main

    assert bench_main(["--smoke", "--network", "loopback", "--methods", "plain,moa", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "client_server.json").read_text())
    speed = {r["method"]: r for r in data["speed"]}
    assert speed["plain"]["calls_per_token"] > speed["moa"]["calls_per_token"]
    assert data["outage"][0]["offline_tokens"] > 0 and data["outage"][0]["identical_to_plain"] == 2
    assert (tmp_path / "client_server.md").is_file()
