"""What runs on a node besides the model server: the monitoring endpoint (`nodemetrics.py`).

The program ships `nodemetrics.py` to every node as a file (a container runs it with the
image's Python); it is part of the deployed program, stdlib only, and never imported by it.
"""

from pathlib import Path

NODEMETRICS_SCRIPT = Path(__file__).with_name("nodemetrics.py")
