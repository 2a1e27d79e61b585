"""Run vLLM's own checks on vLLM launch commands the kit and the chart lead to; run with vLLM's interpreter
(``.venv-vllm``), with an engine's ``vllm/plugin`` on ``PYTHONPATH`` as its ``serve.sh`` sets it (vLLM registers the
kit's draft architectures from there when it loads its plugins). Reads a JSON list of ``{"argv": [...], "cwd":
"..."}`` on stdin and prints one verdict per entry: ``{"ok": true, "world_size": N, "method": "eagle"}`` or
``{"ok": false, "error": "..."}``.

A command goes through what the engine's ``vllm/serve.sh`` runs before it touches a device: the kit's launcher
(``specdec_vllm.serve``) parses it as ``vllm serve`` does, the serve command validates it, and vLLM builds its engine
configuration from it (``EngineArgs.create_engine_config``: parallel layout, node ranks, the speculative config and
the draft's config, read from the engine directory).
"""

from __future__ import annotations

import json
import os
import sys


def check(argv: list[str], cwd: str) -> dict:
    from specdec_vllm.serve import parse_args
    from vllm.engine.arg_utils import AsyncEngineArgs

    saved = os.getcwd()
    os.chdir(cwd)
    try:
        command, args = parse_args(argv)
        command.validate(args)
        args.model = args.model_tag or args.model  # what the serve command does first
        config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
        return {"ok": True, "world_size": config.parallel_config.world_size, "method": config.speculative_config.method}
    except BaseException as exc:  # vLLM refuses with ValueErrors, pydantic errors and SystemExit (argparse)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        os.chdir(saved)


def main() -> None:
    verdicts = [check(command["argv"], command["cwd"]) for command in json.load(sys.stdin)]
    print("VERDICTS " + json.dumps(verdicts))


if __name__ == "__main__":
    main()
