"""Where things are, for every test module wherever it sits: the repository root and the support files."""
import os
from pathlib import Path

#: the repository root (a checkout: setup.py, rlhf/, parallel/, recipes/, tests/ ...)
REPO = Path(__file__).resolve().parents[2]
ROOT = str(REPO)
#: the torchrun check scripts (tests/support/dist/)
DIST_SCRIPTS = os.path.join(ROOT, "tests", "support", "dist")
#: test data kept in the repository (tests/support/fixtures/)
FIXTURES = REPO / "tests" / "support" / "fixtures"
