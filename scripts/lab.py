"""`lab.py`: rehearse a stack in Linux network namespaces, as root (labkit/cli.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
