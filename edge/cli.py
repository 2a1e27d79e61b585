"""``specdec-edge-generate``: generate on a client device against a ``specdec-edge-server``.

The text the target verified prints plainly; text the draft wrote while the server was unreachable, and
that was never verified, prints between ``[unverified]`` ... ``[/unverified]`` (dimmed on a terminal).
``--json`` prints both parts and the statistics (server calls, bytes each way, outages, offline tokens
confirmed or retracted when the server came back).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec_kit.runtime.registry import client_draft_kinds

KINDS = ("none", *client_draft_kinds())  # none: plain decoding over the network (one call per token)


# the activation encodings of ``edge/protocol.py`` (named here so --help need not load torch; a test keeps them equal)
ACT_DTYPE_NAMES = ("float16", "bfloat16", "float32", "int8")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specdec-edge-generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: specdec-edge-generate --server 127.0.0.1:7433 --target zoo/target --draft moa "
        "--draft-path zoo/moa --prompt 'def fib(n):'",
    )
    p.add_argument("--server", default="127.0.0.1:7433", help="HOST:PORT of specdec-edge-server (or of a link relay)")
    p.add_argument(
        "--target",
        type=Path,
        required=True,
        help="target checkpoint on the client (only its last TLI layers and LM head are loaded) with tokenizer",
    )
    p.add_argument("--draft", choices=KINDS, default="moa")
    p.add_argument("--draft-path", type=Path, help="the draft head's checkpoint directory")
    p.add_argument("--source", help="the server's activation source for a MoA head (default: 'moa')")
    p.add_argument("--prompt", action="append", required=True, help="repeatable")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--tree", help="dynamic | static:NAME | choices.json (default dynamic)")
    p.add_argument("--total-tokens", type=int, default=12)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k-tree", type=int, default=2, help="beams per level of a dynamic tree")
    p.add_argument("--act-dtype", choices=list(ACT_DTYPE_NAMES), default="float16", help="activations on the wire")
    p.add_argument("--call-timeout", type=float, default=5.0, help="seconds without an answer before going offline")
    p.add_argument("--retry-interval", type=float, default=0.5, help="seconds between reconnection attempts")
    p.add_argument("--max-offline-tokens", type=int, default=256, help="unverified tokens to draft before waiting")
    p.add_argument(
        "--reconnect-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the server once nothing else can be done",
    )
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from specdec_kit.edge.activations import weights_digest
    from specdec_kit.edge.client import EdgeClient, Offline
    from specdec_kit.edge.drafting import make_edge_drafter
    from specdec_kit.runtime.core.sampling import SamplingParams
    from specdec_kit.runtime.loader import load_tokenizer, resolve_tree

    host, _, port = args.server.rpartition(":")
    if not host or not port.isdigit():
        print(f"error: --server {args.server!r}: expected HOST:PORT", file=sys.stderr)
        return 2
    if args.draft != "none" and args.draft_path is None:
        print(f"error: --draft {args.draft} needs --draft-path", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    try:
        tree = resolve_tree(args.draft, args.tree, args.total_tokens, args.depth, args.top_k_tree)
        drafter = make_edge_drafter(args.draft, args.target, args.draft_path, tree, source=args.source)
        tokenizer = load_tokenizer(args.target)
        params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    client = EdgeClient(
        host,
        int(port),
        drafter,
        call_timeout=args.call_timeout,
        retry_interval=args.retry_interval,
        max_offline_tokens=args.max_offline_tokens,
        reconnect_timeout=args.reconnect_timeout,
        act_dtype=args.act_dtype,
        draft_digest=weights_digest(args.draft_path) if args.draft == "moa" else None,
    )
    tty = sys.stdout.isatty()
    for prompt in args.prompt:
        try:
            result = client.generate(tokenizer(prompt)["input_ids"], args.max_new_tokens, params)
        except (Offline, ValueError, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        verified = tokenizer.decode(result.tokens[: result.verified])
        unverified = tokenizer.decode(result.unverified_tokens) if result.unverified_tokens else ""
        st = result.stats
        stats = {
            "tokens": st.generated,
            "verified": result.verified,
            "tokens_per_s": round(st.tokens_per_s, 2),
            "acceptance_length": round(st.acceptance_length, 3),
            "server_calls": st.calls,
            "calls_per_token": round(st.per_token(st.calls), 3),
            "bytes_up": st.bytes_up,
            "bytes_down": st.bytes_down,
            "outages": st.outages,
            "offline_tokens": st.offline_tokens,
            "confirmed": st.confirmed,
            "retracted": st.retracted,
            "finish_reason": result.finish_reason,
        }
        if args.json:
            print(
                json.dumps({"prompt": prompt, "verified_text": verified, "unverified_text": unverified, "stats": stats})
            )
            continue
        mark = ("\x1b[2m", "\x1b[0m") if tty else ("[unverified]", "[/unverified]")
        print(prompt + verified + (f"{mark[0]}{unverified}{mark[1]}" if unverified else ""))
        print(f"  {stats}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
