"""The command line of ``specdec-edge-server`` (``edge/server.py``): parsed before torch loads."""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="specdec-edge-server",
        description="Verification server for client-server drafting: holds the target; clients draft on their "
        "own device and send draft trees (binary protocol, edge/protocol.py).",
        epilog="Example: specdec-edge-server --target zoo/target --moa-head moa=zoo/moa --moa-head moa_tli0=zoo/moa_tli0 --port 7433",
    )
    p.add_argument("--target", type=Path, required=True, help="Hugging Face checkpoint directory of the target")
    p.add_argument(
        "--moa-head",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a Mixture-of-Attentions head whose LSA runs here (repeatable); EAGLE-style drafts need none",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7433)
    p.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: float32 on CPU)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when present)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU")
    p.add_argument(
        "--max-tree-nodes", type=int, default=1024, help="largest tree (or offline chain) one call may verify"
    )
    p.add_argument(
        "--session-ttl", type=float, default=600.0, help="seconds an idle session is kept for a returning client"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specdec_kit.edge.server import run

    return run(args)
