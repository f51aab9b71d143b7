"""bench/ is a folder of scripts at the repo root, not part of the installed package: make it importable."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
