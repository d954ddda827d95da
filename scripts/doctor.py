"""`doctor.py`: the guide's troubleshooting as one command (tooling/doctor.py; `--lab`:
labkit/cluster/doctor.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from labkit.cluster.doctor import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
