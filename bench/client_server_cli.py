"""Client-server drafting over a shaped network path: tokens/s, server calls and bytes per token, and what
the client does while the server is unreachable.

The server (``specdec-edge-server``, the zoo target and the MoA heads' LSA) runs in its own network
namespace behind a veth pair rate-limited by the kernel's ``tbf``; a link relay (``specdec-edge-link``)
adds the 4G/5G delay, jitter and loss of the paper's setup (this kernel has no ``netem``; see
``edge/link.py``). Without root the server listens on loopback and the relay also paces the rate. The
client (this process, one thread, as on a device) runs every method side by side: prompts interleaved,
one warm-up each. Plain decoding over the network (one call per token) is the remote-API baseline.

The outage run cuts the link silently after ``--outage-after`` verified tokens for ``--outage-s`` seconds:
per method, the tokens drafted offline, how many of them the target confirmed when the link came back,
and whether the final text equals plain decoding's (it must).

(The command line, parsed before torch loads; ``bench/client_server.py`` does the work.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdec_kit.bench.methods import EDGE_METHODS
from specdec_kit.edge.link import PROFILES

# method -> (draft kind, zoo folder or None)
METHODS = EDGE_METHODS


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="specdec-bench-edge", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--zoo", type=Path, default=None, help="the demo zoo (default: $SPECDEC_ZOO, else ./zoo)")
    p.add_argument("--out", type=Path, default=Path("bench_results"))
    p.add_argument("--methods", default="plain,eagle2,moa,moa_tli0", help=f"comma list from {list(METHODS)}")
    p.add_argument("--profiles", default="5g,4g", help=f"comma list from {sorted(PROFILES)}")
    p.add_argument("--network", choices=["auto", "netns", "loopback"], default="auto")
    p.add_argument("--prompt-set", choices=["humaneval", "heldout"], default="humaneval")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--total-tokens", type=int, default=12)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--act-dtype", default="float16")
    p.add_argument(
        "--outage-after", type=int, default=24, help="verified tokens before the link is cut (0: no outage run)"
    )
    p.add_argument("--outage-s", type=float, default=1.5, help="seconds the link stays cut")
    p.add_argument(
        "--call-timeout", type=float, default=0.5, help="seconds without an answer before a client goes offline"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="2 prompts x 16 tokens, 5G only, a 2 s call timeout and a 4 s outage (a quick check that a busy "
        "machine's slow call does not turn into an outage)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from specdec_kit.bench.client_server import run

    return run(args)
