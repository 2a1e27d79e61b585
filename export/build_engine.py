"""``python export/build_engine.py --draft griffin``: build an engine directory (see ``--help``).

A thin launcher: the work lives in the ``specdec_kit.export`` package (``cli.py``, ``builder.py``).
"""

import sys
from pathlib import Path

# Run as a script, this folder is sys.path[0]; drop it so its module names cannot shadow installed packages.
_here = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != _here]

from specdec_kit.export.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
