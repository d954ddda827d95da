"""The lab's huggingface_hub, inside the vLLM stand-in image only (labkit/images/standins.py app_layer).

No Hub here: `snapshot_download`, what the staging's weights fetch calls
(qwen_cluster/render/weights.py), writes what it would have fetched, and from where, into the
cache it was given (HF_HOME, the host cache the staging mounts): one JSON file per model under
`lab-weights/`, naming the image that fetched it. It downloads nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

LAB_WEIGHTS_DIR = "lab-weights"
LAB_FILE = "/etc/qcl-lab/image.json"  # labkit/images/imagebin.py LAB_FILE


def snapshot_download(repo_id: str, **_: object) -> str:
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    try:
        image = json.loads(Path(LAB_FILE).read_text()).get("image", "")
    except (OSError, ValueError):
        image = ""
    record = home / LAB_WEIGHTS_DIR / f"{repo_id.replace('/', '--')}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    partial = record.with_name(f".{record.name}.{os.getpid()}")
    partial.write_text(json.dumps({"model": repo_id, "image": image, "endpoint": endpoint}))
    os.replace(partial, record)
    return f"{home}/hub/models--{repo_id.replace('/', '--')}"
