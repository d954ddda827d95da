"""`demo.py`: the main job, every stack's offline preview and the lab rehearsal (labkit/demo.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.demo import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
