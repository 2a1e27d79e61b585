"""Run SGLang's own code on what the kit writes; run with SGLang's interpreter (``.venv-sglang``).

Reads a JSON list on stdin and prints one JSON verdict per entry. ``{"argv": [...], "env": {...}, "cwd": "...",
"pythonpath": [...]}`` is a launch command: ``{"ok": true}`` or ``{"ok": false, "error": "<exception>: <SGLang's
message>"}``. ``{"resolve": [architectures], "package": "...", "pythonpath": [...]}`` imports a model package
as ``SGLANG_EXTERNAL_MODEL_PACKAGE`` makes SGLang do and resolves the architectures in SGLang's model registry:
``{"ok": true, "module": ..., "class": ..., "architecture": ...}``. ``{"engine_kwargs": {...}}`` is what
``sglang.Engine(**kwargs)`` would be given (the kit's regeneration worker): ``ServerArgs`` built from them and
checked the same way as a launch command. A launch command goes
through exactly what the engine's ``sglang/launch.py`` runs before it touches a device: ``prepare_server_args``
(argparse; the launcher adds the API key from the environment), ``ServerArgs.resolve_once`` (the resolution pipeline, which reads the model's config) and
``check_server_args``. ``--device cuda`` is appended unless given, since this machine has no accelerator and
SGLang's device probe would refuse before any check.

One stand-in: PyPI's torchvision is a CUDA build that cannot load beside the CPU torch, and SGLang's config
package imports ``torchvision.transforms`` for image models at import time; an inert module takes its place
(no text model's checks touch it; transformers is imported first, so it still sees no torchvision).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import io
import json
import os
import sys
import types


def install_torchvision_standin() -> None:
    class Inert:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Inert()

    def module(name: str) -> types.ModuleType:
        mod = types.ModuleType(name)

        def attribute(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return Inert

        mod.__getattr__ = attribute  # type: ignore[method-assign]
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = mod
        return mod

    root, transforms, functional = (
        module("torchvision"),
        module("torchvision.transforms"),
        module("torchvision.transforms.functional"),
    )
    root.transforms, transforms.functional = transforms, functional


def engine_launcher(cwd: str):
    """The engine's own launcher (``sglang/launch.py``: the API key from the environment, the version check)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("specdec_sglang_launch", os.path.join(cwd, "sglang", "launch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(argv: list[str], env: dict[str, str], cwd: str) -> dict:
    """A launch command through the engine's launcher and SGLang's checks; with an API key in ``env``, also whether
    SGLang got it and whether it shows anywhere SGLang reports its arguments."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        launcher = engine_launcher(cwd)
        from sglang.version import __version__

        if "--device" not in argv:
            argv = [*argv, "--device", "cuda"]
        key = env.get("SPECDEC_API_KEY")
        with contextlib.redirect_stdout(io.StringIO()):
            args = launcher.prepare(argv)
            args.resolve_once()
            args.check_server_args()
        verdict = {"ok": True, "version_note": launcher.version_note(__version__)}
        if key:
            reports = [repr(args), json.dumps(args.resolved_dict(), default=str), str(args.launch_command)]
            verdict.update(
                key_in_effect=args.api_key == key,
                key_shown=any(key in report for report in reports),
                key_inherited="SPECDEC_API_KEY" in os.environ,
            )
        return verdict
    except BaseException as exc:  # SGLang refuses with assertions, ValueErrors and SystemExit (argparse)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)


def check_engine_kwargs(kwargs: dict) -> dict:
    """``sglang.Engine``'s own construction of its arguments, then the same checks as a launch command."""
    from sglang.srt.server_args import ServerArgs

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = ServerArgs(**{"device": "cuda", **kwargs})
            args.resolve_once()
            args.check_server_args()
        return {"ok": True}
    except BaseException as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def resolve(architectures: list[str], package: str) -> dict:
    from sglang.srt.models.registry import ModelRegistry, import_model_classes

    try:
        ModelRegistry.models.update(import_model_classes(package, strict=True))  # as registry.py does for the env var
        cls, arch = ModelRegistry.resolve_model_cls(architectures)
        return {"ok": True, "module": cls.__module__, "class": cls.__name__, "architecture": arch}
    except BaseException as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    import transformers.utils.import_utils  # noqa: F401  (decides "no torchvision" before the stand-in exists)

    install_torchvision_standin()
    commands = json.load(sys.stdin)
    verdicts = []
    for command in commands:
        for path in command.get("pythonpath", []):  # a GRIFFIN engine's model package, as serve.sh sets it
            if path not in sys.path:
                sys.path.insert(0, path)
        if "resolve" in command:
            verdicts.append(resolve(command["resolve"], command["package"]))
        elif "engine_kwargs" in command:
            verdicts.append(check_engine_kwargs(command["engine_kwargs"]))
        else:
            verdicts.append(check(command["argv"], command.get("env", {}), command.get("cwd", ".")))
    print("VERDICTS " + json.dumps(verdicts))


if __name__ == "__main__":
    main()
