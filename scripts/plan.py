"""`plan.py`: the offline preview and change plan of a stack (tooling/preview.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tooling.preview import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
