"""`vllm serve` on an AWS lab node: the stand-in model server (labkit/shims.py `vllm`), serving
`--served-model-name` when given (the S3 copy is served as model.name, qwen_cluster/render/
weights.py), and refusing to start, as vLLM does with HF_HUB_OFFLINE=1, when the model
directory it is given is not in the container (the staging did not put it there)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from labkit import shims, standins


def _on_host(path: str) -> Path | None:
    """Where the container's `path` is on the node: through the container's mounts."""
    host = standins.Host(
        node=os.environ["QCL_LAB_NODE"],
        namespace=os.environ["QCL_LAB_NAMESPACE"],
        ip=os.environ.get("QCL_LAB_NODE_IP", ""),
        etc_root=os.environ["QCL_LAB_ETC"],
        state_dir=os.environ["QCL_LAB_NODE_STATE"],
        bin_dir=os.environ["QCL_LAB_BIN"],
    )
    name = os.environ.get("QCL_LAB_CONTAINER", "")
    deadline = time.monotonic() + 5
    record = standins.read_record(host, name)
    while record is None and time.monotonic() < deadline:  # written just after the spawn
        time.sleep(0.05)
        record = standins.read_record(host, name)
    volumes = (record.container.get("volumes") if record else None) or {}
    for container_path in sorted(volumes, key=len, reverse=True):
        if path == container_path or path.startswith(container_path.rstrip("/") + "/"):
            return Path(volumes[container_path] + path[len(container_path) :])
    return None


def main(args: list[str]) -> int:
    if args[:1] == ["serve"] and len(args) > 1 and args[1].startswith("/"):
        where = _on_host(args[1])
        if where is None or not (where / "config.json").is_file():
            print(f"OSError: {args[1]} does not appear to have a file named config.json (lab: the "
                  "weights were not staged into the container's cache)", file=sys.stderr)  # fmt: skip
            return 1
    served = next((word.split("=", 1)[1] for word in args if word.startswith("--served-model-name=")), None)
    if served and len(args) > 1:
        args = ["serve", served, *args[2:]]
    return shims.vllm(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
