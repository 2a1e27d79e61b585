"""``python export/build_engine.py --draft griffin``: build an engine directory (see ``--help``).

A thin launcher: the work lives in the ``specdec_kit.export`` package (``cli.py``, ``builder.py``).
"""

import sys
from pathlib import Path

# Run as a script, this folder is sys.path[0]; drop it so its module names cannot shadow installed packages.
_here = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != _here]

try:
    from specdec_kit.export.cli import main
except ModuleNotFoundError as exc:  # the kit is not installed in this interpreter
    sys.exit(
        f"error: {exc.name} is missing from {sys.executable}; set up the kit first (bash scripts/setup.sh, "
        "then .venv/bin/python export/build_engine.py ...) or pip install -e . into this environment"
    )

if __name__ == "__main__":
    sys.exit(main())
