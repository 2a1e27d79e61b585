"""Run vLLM's own checks on vLLM launch commands the kit and the chart lead to; run with vLLM's interpreter
(``.venv-vllm``), with an engine's ``vllm/plugin`` on ``PYTHONPATH`` as its ``serve.sh`` sets it (vLLM registers the
kit's draft architectures from there when it loads its plugins). Reads a JSON list of ``{"argv": [...], "cwd":
"..."}`` on stdin and prints one verdict per entry: ``{"ok": true, "world_size": N, "method": "eagle"}`` or
``{"ok": false, "error": "..."}``; with ``"api_key"``, also what vLLM's API middleware answers with that key in
``VLLM_API_KEY`` (``"statuses"``).

A command goes through what the engine's ``vllm/serve.sh`` runs before it touches a device: the kit's launcher
(``specdec_vllm.serve``) parses it as ``vllm serve`` does, the serve command validates it, and vLLM builds its engine
configuration from it (``EngineArgs.create_engine_config``: parallel layout, node ranks, the speculative config and
the draft's config, read from the engine directory).
"""

from __future__ import annotations

import json
import os
import sys


def statuses_with_key(args, key: str) -> dict:
    """What vLLM's own API middleware (built from ``args`` with ``VLLM_API_KEY`` set, as specdec-serve hands the key
    over) answers on an OpenAI route: without a key, with a wrong one, with the right one."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm import envs
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    os.environ["VLLM_API_KEY"] = key
    if hasattr(envs, "disable_envs_cache"):  # vLLM may have cached its environment variables already
        envs.disable_envs_cache()
    app = FastAPI()
    app.get("/v1/models")(lambda: {"data": []})
    init_entrypoints_middleware(args, app, ())
    client = TestClient(app)
    return {
        "none": client.get("/v1/models").status_code,
        "wrong": client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code,
        "right": client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code,
    }


def check(argv: list[str], cwd: str, api_key: str | None = None) -> dict:
    from specdec_vllm.serve import parse_args
    from vllm.engine.arg_utils import AsyncEngineArgs

    saved = os.getcwd()
    os.chdir(cwd)
    try:
        command, args = parse_args(argv)
        command.validate(args)
        args.model = args.model_tag or args.model  # what the serve command does first
        config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
        verdict = {
            "ok": True,
            "world_size": config.parallel_config.world_size,
            "method": config.speculative_config.method,
        }
        if api_key:
            verdict["statuses"] = statuses_with_key(args, api_key)
        return verdict
    except BaseException as exc:  # vLLM refuses with ValueErrors, pydantic errors and SystemExit (argparse)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        os.chdir(saved)


def main() -> None:
    verdicts = [check(c["argv"], c["cwd"], c.get("api_key")) for c in json.load(sys.stdin)]
    print("VERDICTS " + json.dumps(verdicts))


if __name__ == "__main__":
    main()
