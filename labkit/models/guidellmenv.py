"""guidellm, one of the field's benchmark tools (vllm-project/guidellm), in a virtualenv cached
outside the clone, as labkit/models/realvllm.py keeps the real vLLM.

- `ensure_venv()` installs the pinned `requirements-guidellm.txt` (guidellm 0.8.1, the CPU build
  of torch it requires, and the rest of what it declares) with `pip install --no-deps` under
  `cache_root()/guidellm-<key>`; the key hashes that file, the recipe and the interpreter, as
  realvllm's does, so a changed pin builds a new environment and an unchanged one is reused
  (a cold install takes a minute or two, a cached one milliseconds). One builder at a time
  (realvllm.build_once: a lock file beside it).
- `executable()` is its `guidellm` command; labkit/cluster/guidellmbench.py runs it, with
  `lab_tokenizer()` against the lab.

The command line: `python -m labkit.models.guidellmenv install|paths`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from labkit.models import realvllm

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements-guidellm.txt"
VERSION = "0.8.1"
# Bump when the steps below change in a way the requirements file does not show.
RECIPE_VERSION = "1"
# The console script the wheel declares (entry_points.txt: guidellm.__main__:cli).
SCRIPT = "guidellm"


def venv_key() -> str:
    return realvllm.pinned_venv_key(REQUIREMENTS, RECIPE_VERSION)


def venv_dir() -> Path:
    return realvllm.cache_root() / f"guidellm-{venv_key()}"


def executable(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / SCRIPT


def ensure_venv(log: Callable[[str], None] = print) -> Path:
    """The cached environment, built first when missing (realvllm.build_once)."""
    return realvllm.ensure_pinned_venv(
        venv_dir(), REQUIREMENTS, SCRIPT, "guidellm environment", log, pip_options=realvllm.torch_source
    )


def lab_tokenizer(log: Callable[[str], None] = print) -> Path:
    """The tokenizer guidellm sizes its synthetic prompts with in the lab: the tiny Qwen3 model's
    directory (realvllm.ensure_model, built when missing), the model the lab's replicas serve.
    Only its tokenizer files are read; no vLLM server is started."""
    return realvllm.ensure_model(log)


def main(argv: list[str] | None = None) -> int:
    return realvllm.cache_cli(
        argv,
        "python -m labkit.models.guidellmenv",
        __doc__,
        {"install": ("build (or find) the cached guidellm environment; print its path", ensure_venv)},
        lambda: {"venv": venv_dir()},
    )


if __name__ == "__main__":
    sys.exit(main())
