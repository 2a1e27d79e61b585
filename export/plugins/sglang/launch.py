"""SGLang's server (what ``python -m sglang.launch_server`` runs), with its API key taken from the environment.

SGLang takes its key only as ``--api-key``, where every process listing shows it, and it writes the key back out: in
the server arguments it logs at start-up, in ``/server_info`` and in the launch command it records. This launcher
reads the key from ``$SPECDEC_API_KEY`` (the variable is then removed, so SGLang's child processes do not inherit
it), hands it to SGLang's own argument code inside this process, and redacts it wherever SGLang reports its
arguments. Written into every SGLang engine as ``sglang/launch.py``; ``sglang/serve.sh`` runs it. It needs SGLang
alone (no specdec-kit in SGLang's environment).
"""

from __future__ import annotations

import os
import sys

CHECKED_VERSION = "0.5.23"  # the SGLang whose argument code checked the kit's commands and refusals
KEY_VARIABLE = "SPECDEC_API_KEY"
SECRET_FIELDS = ("api_key", "admin_api_key")
REDACTED = "<redacted>"


def redact_reports(server_args_class: type) -> None:
    """SGLang's reports of its arguments (the start-up log and /server_info read ``resolved_dict``; ``repr``)
    show the secret fields as ``<redacted>``."""
    resolved = server_args_class.resolved_dict

    def resolved_dict(self):
        values = resolved(self)
        for name in SECRET_FIELDS:
            if values.get(name):
                values[name] = REDACTED
        return values

    def masked_repr(self) -> str:
        values = resolved_dict(self)
        return "ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in values.items()) + ")"

    server_args_class.resolved_dict = resolved_dict
    server_args_class.__repr__ = masked_repr


def redacted_command(argv: list[str]) -> list[str]:
    """``argv`` with the value after each secret flag replaced."""
    flags = {"--" + name.replace("_", "-") for name in SECRET_FIELDS}
    out, hide = [], False
    for arg in argv:
        name = arg.split("=", 1)[0]
        if hide:
            out.append(REDACTED)
        elif name in flags and "=" in arg:
            out.append(f"{name}={REDACTED}")
        else:
            out.append(arg)
        hide = arg in flags
    return out


def version_note(installed: str) -> str | None:
    """A warning when the SGLang that will run is not the one the kit's commands were checked against (an image
    built on another base): its arguments may mean something else or be refused; None when they agree."""
    if installed == CHECKED_VERSION:
        return None
    return (
        f"specdec: this is SGLang {installed}; the engine's launch command and the kit's refusals were checked "
        f"against SGLang {CHECKED_VERSION}: arguments it renamed or checks it added show up here first"
    )


def prepare(argv: list[str]):
    """SGLang's server arguments for ``argv``, the key from the environment added (never to the process's command
    line) and redacted from what SGLang reports."""
    from sglang.srt import server_args as sglang_args

    redact_reports(sglang_args.ServerArgs)
    key = os.environ.pop(KEY_VARIABLE, None)
    if key and any(a.split("=", 1)[0] == "--api-key" for a in argv):
        raise SystemExit(f"an API key is given twice: in ${KEY_VARIABLE} and as --api-key; give it in ${KEY_VARIABLE}")
    args = sglang_args.prepare_server_args([*argv, "--api-key", key] if key else argv)
    command = getattr(args, "_launch_command", None)
    if isinstance(command, str):
        args._launch_command = " ".join(redacted_command(command.split(" ")))
    elif isinstance(command, list):
        args._launch_command = redacted_command(command)
    return args


def main() -> None:
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.utils import kill_process_tree
    from sglang.version import __version__

    load_plugins()
    note = version_note(__version__)
    if note:
        print(note, file=sys.stderr, flush=True)
    args = prepare(sys.argv[1:])
    try:
        run_server(args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
