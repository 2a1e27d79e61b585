"""``python -m specdec_kit.serving``: see ``cli.py``."""

import sys

from specdec_kit.serving.cli import main

sys.exit(main())
