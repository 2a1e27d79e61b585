"""The work of the client-server benchmark; what it measures, how, and its
options are in ``client_server_cli.py`` (the command line, parsed before torch loads)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdec_kit.bench.methods import EDGE_METHODS as METHODS
from specdec_kit.bench.report import write_text_and_plot
from specdec_kit.data import prompts as prompt_sets
from specdec_kit.edge.activations import weights_digest
from specdec_kit.edge.client import EdgeClient
from specdec_kit.edge.drafting import make_edge_drafter
from specdec_kit.edge.link import PROFILES
from specdec_kit.edge.netns import NetnsLink
from specdec_kit.paths import default_zoo
from specdec_kit.plots import legend_below, pyplot, save_figure
from specdec_kit.runtime.core.trees import DynamicTreeConfig
from specdec_kit.runtime.loader import load_tokenizer
from specdec_kit.train.corpus import heldout_prompts

SERVER_PORT = 7433


def _wait_port(host: str, port: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until ``host:port`` accepts (the server namespace is reachable over the veth pair from here)."""
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:6]} exited with {proc.returncode}")
        try:
            socket.create_connection((host, port), 1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{host}:{port} did not come up in {timeout:.0f} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ShapedPath:
    """Server (in a namespace when possible) + link relay for one profile; a context manager."""

    def __init__(self, args, profile: str, heads: list[str], use_netns: bool):
        self.args, self.profile, self.heads, self.use_netns = args, profile, heads, use_netns
        self.ns: NetnsLink | None = None
        self.procs: list[subprocess.Popen] = []

    def __enter__(self):
        prof = PROFILES[self.profile]
        prefix: list[str] = []
        host = "127.0.0.1"
        if self.use_netns:
            self.ns = NetnsLink("specdec-bench", rate_mbit=prof.rate_mbit).__enter__()
            prefix, host = self.ns.exec_prefix, self.ns.server_ip
        port = SERVER_PORT if self.use_netns else _free_port()
        cmd = prefix + [
            sys.executable,
            "-m",
            "specdec_kit.edge.server",
            "--target",
            str(self.args.zoo / "target"),
            "--host",
            host,
            "--port",
            str(port),
            "--threads",
            "1",
        ]
        for h in self.heads:
            cmd += ["--moa-head", f"{h}={self.args.zoo / h}"]
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(server)
        _wait_port(host, port, server)
        self.port = _free_port()
        link = [
            sys.executable,
            "-m",
            "specdec_kit.edge.link",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--upstream",
            f"{host}:{port}",
            "--profile",
            self.profile,
        ] + (["--no-rate"] if self.use_netns else [])
        self.link = subprocess.Popen(link, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(self.link)
        _wait_port("127.0.0.1", self.port, self.link)
        return self

    def wire_bytes(self) -> int:
        return sum(self.ns.wire_bytes()) if self.ns else 0

    def cut(self) -> None:
        self.link.send_signal(signal.SIGUSR1)

    def restore(self) -> None:
        self.link.send_signal(signal.SIGUSR2)

    def __exit__(self, *exc):
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.ns:
            self.ns.close()


def make_clients(args, names: list[str], port: int, tree) -> dict[str, EdgeClient]:
    clients = {}
    for name in names:
        kind, folder = METHODS[name]
        path = args.zoo / folder if folder else None
        drafter = make_edge_drafter(kind, args.zoo / "target", path, tree, source=folder if kind == "moa" else None)
        clients[name] = EdgeClient(
            "127.0.0.1",
            port,
            drafter,
            act_dtype=args.act_dtype,
            call_timeout=args.call_timeout,
            retry_interval=0.2,
            reconnect_timeout=10.0,
            draft_digest=weights_digest(path) if kind == "moa" else None,
        )
    return clients


def speed_rows(args, path: ShapedPath, clients: dict[str, EdgeClient], prompts: list[list[int]], bar) -> list[dict]:
    agg = {
        m: dict(tokens=0, wall=0.0, calls=0, up=0, down=0, wire=0, cycles=0, accepted=0, prompt_down=0) for m in clients
    }
    for m, c in clients.items():  # warm-up: connection, first-call costs
        c.generate(prompts[0], 8)
    for rep in range(args.repeats):
        for ids in prompts:
            for m, c in clients.items():
                before = path.wire_bytes()
                r = c.generate(ids, args.max_new_tokens)
                st, a = r.stats, agg[m]
                a["wire"] += path.wire_bytes() - before
                a["tokens"] += len(r.tokens)
                a["wall"] += st.wall_s
                a["calls"] += st.calls
                a["up"] += st.bytes_up
                a["down"] += st.bytes_down
                a["prompt_down"] += st.prompt_bytes_down
                a["cycles"] += st.cycles
                a["accepted"] += st.accepted
                bar.update(1)
    rows = []
    for m, a in agg.items():
        n = max(a["tokens"], 1)
        rows.append(
            dict(
                profile=path.profile,
                method=m,
                tokens=a["tokens"],
                tokens_per_s=a["tokens"] / a["wall"],
                acceptance_length=(a["accepted"] + a["cycles"]) / max(a["cycles"], 1),
                calls_per_token=a["calls"] / n,
                bytes_up_per_token=a["up"] / n,
                bytes_down_per_token=a["down"] / n,
                decode_bytes_down_per_token=(a["down"] - a["prompt_down"]) / n,
                prompt_bytes_down_per_request=a["prompt_down"] / max(len(prompts) * args.repeats, 1),
                wire_bytes_per_token=a["wire"] / n if path.ns else None,
            )
        )
    base = next((r["tokens_per_s"] for r in rows if r["method"] == "plain"), None)
    for r in rows:
        r["speedup_vs_plain"] = r["tokens_per_s"] / base if base else None
    return rows


def outage_rows(
    args, path: ShapedPath, clients: dict[str, EdgeClient], prompts: list[list[int]], reference, bar
) -> list[dict]:
    rows = []
    for m, c in clients.items():
        tot = dict(offline=0, confirmed=0, retracted=0, identical=0, during=0)
        for i, ids in enumerate(prompts):
            state = {"verified": 0, "cut_at": None, "during": 0}

            def sink(kind, toks, state=state):
                if kind == "verified":
                    state["verified"] += len(toks)
                    if state["cut_at"] is None and state["verified"] >= args.outage_after:
                        path.cut()
                        state["cut_at"] = time.perf_counter()
                elif kind == "unverified" and state["cut_at"] is not None:
                    state["during"] += 1

            def restore_later(state=state):
                while state["cut_at"] is None:
                    time.sleep(0.01)
                time.sleep(max(0.0, args.outage_s - (time.perf_counter() - state["cut_at"])))
                path.restore()

            cutter = threading.Thread(target=restore_later, daemon=True)
            cutter.start()
            r = c.generate(ids, args.max_new_tokens, on_event=sink)
            cutter.join(timeout=args.outage_s + 5)
            st = r.stats
            tot["offline"] += st.offline_tokens
            tot["confirmed"] += st.confirmed
            tot["retracted"] += st.retracted
            tot["during"] += state["during"]
            tot["identical"] += int(r.tokens == reference[i] and r.verified == len(r.tokens))
            bar.update(1)
        rows.append(
            dict(
                profile=path.profile,
                method=m,
                prompts=len(prompts),
                offline_tokens=tot["offline"],
                confirmed=tot["confirmed"],
                retracted=tot["retracted"],
                confirmed_share=tot["confirmed"] / tot["offline"] if tot["offline"] else None,
                identical_to_plain=tot["identical"],
            )
        )
    return rows


def markdown(speed: list[dict], outage: list[dict], meta: dict) -> list[str]:
    lines = [
        f"# Client-server drafting ({meta['network']})",
        "",
        f"Zoo target on {meta['machine']}; {meta['prompts']} {meta['prompt_set']} prompts x {meta['max_new_tokens']} "
        f"tokens, greedy, tree {meta['tree']}, activations {meta['act_dtype']}. Bytes are protocol frames ("
        'with headers; "down" includes the prompt\'s activations, "decode down" leaves them out); wire bytes are what the '
        "veth carried both ways, TCP/IP headers and ACKs included.",
        "",
        "| profile | method | tokens/s | vs plain | tau | server calls/token | bytes up/token | bytes down/token | decode bytes down/token | prompt bytes down/request | wire bytes/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in speed:
        wire = f"{r['wire_bytes_per_token']:.0f}" if r["wire_bytes_per_token"] is not None else "-"
        vs = f"{r['speedup_vs_plain']:.2f}x" if r["speedup_vs_plain"] else "-"
        lines.append(
            f"| {r['profile']} | {r['method']} | {r['tokens_per_s']:.1f} | {vs} | {r['acceptance_length']:.2f} | "
            f"{r['calls_per_token']:.3f} | {r['bytes_up_per_token']:.0f} | {r['bytes_down_per_token']:.0f} | "
            f"{r['decode_bytes_down_per_token']:.0f} | {r['prompt_bytes_down_per_request']:.0f} | {wire} |"
        )
    if outage:
        lines += [
            "",
            f"## Outage: link cut silently after {meta['outage_after']} verified tokens for {meta['outage_s']} s",
            "",
            "| profile | method | offline tokens | confirmed on return | retracted | confirmed share | final text = plain decoding |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in outage:
            share = f"{r['confirmed_share']:.0%}" if r["confirmed_share"] is not None else "-"
            lines.append(
                f"| {r['profile']} | {r['method']} | {r['offline_tokens']} | {r['confirmed']} | {r['retracted']} | "
                f"{share} | {r['identical_to_plain']}/{r['prompts']} |"
            )
    return lines


# the names the README's table uses
PLOT_LABELS = {"plain": "plain (remote API)", "eagle2": "EAGLE-2", "moa": "MoA TLI 1", "moa_tli0": "MoA TLI 0"}


def plot(speed: list[dict], out: Path) -> None:
    plt = pyplot()

    profiles = list(dict.fromkeys(r["profile"] for r in speed))
    methods = list(dict.fromkeys(r["method"] for r in speed))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        rows = [next(r for r in speed if r["profile"] == p and r["method"] == m) for p in profiles]
        xs = [i + j * width for i in range(len(profiles))]
        label = PLOT_LABELS.get(m, m)
        axes[0].bar(xs, [r["tokens_per_s"] for r in rows], width, label=label)
        axes[1].bar(xs, [r["calls_per_token"] for r in rows], width, label=label)
    for ax, title in zip(axes, ("tokens/s", "server calls per token")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(profiles))], [p.upper() for p in profiles])
        ax.set_title(title)
    legend_below(fig, axes[0])
    save_figure(fig, out, tight=False)


def run(args) -> int:
    args.zoo = args.zoo or default_zoo()
    if args.smoke:
        args.prompts, args.max_new_tokens, args.profiles, args.outage_after = 2, 16, "5g", 6
        args.call_timeout, args.outage_s = 2.0, 4.0
    torch.set_num_threads(1)
    names = [m for m in args.methods.split(",") if m]
    for m in names:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; expected one of {list(METHODS)}")
    ok, why = NetnsLink.available()
    use_netns = args.network == "netns" or (args.network == "auto" and ok)
    if use_netns and not ok:
        raise SystemExit(f"--network netns: {why}")
    network = (
        "network namespace + veth with tbf rate limit + link relay (delay/jitter/loss)"
        if use_netns
        else f"loopback + link relay (delay/jitter/loss/rate){'' if ok else f'; no namespaces: {why}'}"
    )
    tokenizer = load_tokenizer(args.zoo / "target")
    texts = prompt_sets.humaneval(args.prompts) if args.prompt_set == "humaneval" else heldout_prompts(args.prompts)
    prompts = [tokenizer(t)["input_ids"][-512:] for t in texts]
    tree = DynamicTreeConfig(args.total_tokens, args.depth, args.top_k)
    heads = sorted({METHODS[m][1] for m in names if METHODS[m][0] == "moa"})
    profiles = [p for p in args.profiles.split(",") if p]
    offline_methods = [m for m in names if m != "plain"]
    total = len(profiles) * (len(prompts) * len(names) * args.repeats) + (
        len(prompts) * len(offline_methods) if args.outage_after else 0
    )
    bar = tqdm(total=total, desc="client-server", file=sys.stderr)
    speed, outage = [], []
    reference = None
    for profile in profiles:
        with ShapedPath(args, profile, heads, use_netns) as path:
            clients = make_clients(args, names, path.port, tree)
            speed += speed_rows(args, path, clients, prompts, bar)
            if args.outage_after and profile == profiles[0]:
                plain = clients.get("plain") or make_clients(args, ["plain"], path.port, tree)["plain"]
                reference = [plain.generate(ids, args.max_new_tokens).tokens for ids in prompts]
                outage += outage_rows(args, path, {m: clients[m] for m in offline_methods}, prompts, reference, bar)
    bar.close()
    meta = dict(
        network=network,
        machine=f"{os.cpu_count()} CPU cores (client and server share them)",
        prompts=len(prompts),
        prompt_set=args.prompt_set,
        max_new_tokens=args.max_new_tokens,
        tree=f"dynamic {args.total_tokens}/{args.depth}/{args.top_k}",
        act_dtype=args.act_dtype,
        outage_after=args.outage_after,
        outage_s=args.outage_s,
        call_timeout_s=args.call_timeout,
        profiles={p: PROFILES[p].describe() for p in profiles},
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "client_server.json").write_text(json.dumps({"meta": meta, "speed": speed, "outage": outage}, indent=2))
    write_text_and_plot(args.out, "client_server", markdown(speed, outage, meta), lambda p: plot(speed, p))
    return 0


if __name__ == "__main__":  # the command line lives in the light module, which runs this one
    from specdec_kit.bench.client_server_cli import main

    raise SystemExit(main())
