"""`bench.py`: benchmarks that print figures measured in one run (tooling/bench.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tooling.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
