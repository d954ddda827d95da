"""`hostkeys.py`: pin a bare-metal stack's SSH host keys in its stack file (tooling/hostkeys.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tooling.hostkeys import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
