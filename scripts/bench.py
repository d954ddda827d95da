"""`bench.py`: figures measured in one run (labkit/bench.py: the lab, and tooling/bench.py: renders)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
