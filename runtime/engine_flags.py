"""Command-line flags that open an engine the same way from every command that serves or runs one."""

from __future__ import annotations

import argparse


def add_joined_vocab_argument(p: argparse.ArgumentParser) -> None:
    """``--joined-vocab on|off`` (``open_engine``'s ``joined_vocab``)."""
    p.add_argument(
        "--joined-vocab",
        choices=["on", "off"],
        default="on",
        help="a head with a reduced draft vocabulary (GRIFFIN, EAGLE, HASS with d2t): on (the default), each "
        "request's own tokens outside it (its prompt's, then its output's) join it, so names, numbers and "
        "identifiers copied from the prompt can be drafted; off: the vocabulary stays as trained (a fixed draft "
        "cost; an ONNX Runtime engine then never reads its joined_vocab file, the target's LM head). The output is "
        "the target's either way",
    )


def joined_vocab(args: argparse.Namespace) -> bool:
    """The parsed flag as ``open_engine`` and ``make_drafter`` take it."""
    return args.joined_vocab == "on"
