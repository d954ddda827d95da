"""vLLM's router for the lab: `vllm-router` from PyPI in a virtualenv cached outside the clone,
as labkit/models/realvllm.py keeps the real vLLM, and the image trees that put it in the lab's images.

- `ensure_venv()` installs the pinned `requirements-vllm-router.txt` (the wheel of
  vllm-project/router, a Rust binary in an abi3 wheel, no torch, and its Python launcher's
  dependencies) with `pip install --no-deps` under `cache_root()/vllm-router-<key>`; the key
  hashes that file, the recipe and the interpreter, as realvllm's does.
- `command()` is the router's command line for a set of workers, for the lab's own runs on
  loopback (the benchmark's runner, the suite's rehearsal); a deployed router runs the
  program's rendered line.
- `image_trees()` is what the lab's router image carries: the environment at its own path and
  the host libraries its native code links, on the lab's Python layer (labkit/images/standins.py).

The command line: `python -m labkit.models.router install|paths`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from labkit.models import realvllm
from qwen_cluster.render import router as program_router

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements-vllm-router.txt"
VERSION = "0.1.17"
# Bump when the steps below change in a way the requirements file does not show.
RECIPE_VERSION = "1"
# The console script the wheel declares (entry_points.txt: vllm_router.launch_router:main).
SCRIPT = "vllm-router"


def venv_key() -> str:
    return realvllm.pinned_venv_key(REQUIREMENTS, RECIPE_VERSION)


def venv_dir() -> Path:
    return realvllm.cache_root() / f"vllm-router-{venv_key()}"


def executable(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / SCRIPT


def ensure_venv(log: Callable[[str], None] = print) -> Path:
    """The cached environment, built first when missing (seconds from pip's cache, 24 MB of
    wheel from PyPI otherwise; realvllm.build_once)."""
    return realvllm.ensure_pinned_venv(venv_dir(), REQUIREMENTS, SCRIPT, "vllm-router environment", log)


def command(
    workers: list[str],
    *,
    host: str,
    port: int,
    metrics_port: int,
    policy: str = "cache_aware",
    balance_abs_threshold: int | None = None,
    balance_rel_threshold: float | None = None,
    health_check_interval_secs: int = 2,
    log_level: str = "warning",
    venv: Path | None = None,
    kv_event_sources: dict[str, str] | None = None,
    kv_event_block_size: int | None = None,
    kv_event_model: str | None = None,
) -> list[str]:
    """The router's command line (flags of vllm_router/router_args.py in the 0.1.17 wheel).
    Its Prometheus listener is on by default (port 29000 on 127.0.0.1), so it is always
    placed; health checks every `health_check_interval_secs` (the release's default, 60 s,
    would keep a dead worker in the set for minutes). kv_aware: `kv_event_sources` maps each
    worker URL to its replica's ZMQ publisher, with the replicas' block size and a model
    identity (the program's own line: qwen_cluster/render/router.py policy_flags)."""
    argv = [
        str(executable(venv)),
        "--host", host,
        "--port", str(port),
        "--worker-urls", *workers,
        "--policy", policy,
        "--prometheus-host", host,
        "--prometheus-port", str(metrics_port),
        "--health-check-interval-secs", str(health_check_interval_secs),
        "--log-level", log_level,
    ]  # fmt: skip
    if balance_abs_threshold is not None:
        argv += ["--balance-abs-threshold", str(balance_abs_threshold)]
    if balance_rel_threshold is not None:
        argv += ["--balance-rel-threshold", str(balance_rel_threshold)]
    for worker, endpoint in (kv_event_sources or {}).items():
        argv += ["--kv-event-source", f"{worker}={endpoint}"]
    if kv_event_block_size is not None:
        argv += ["--kv-event-block-size", str(kv_event_block_size)]
    if kv_event_model is not None:
        argv += ["--kv-event-model", kv_event_model]
    return argv


def pd_command(
    prefill: list[str],
    decode: list[str],
    *,
    host: str,
    port: int,
    metrics_port: int,
    health_check_interval_secs: int = 2,
    log_level: str = "warning",
    venv: Path | None = None,
) -> list[str]:
    """The router in prefill/decode mode, its P/D flags as the program renders them
    (qwen_cluster/render/router.py pd_worker_flags) for the lab's own worker URLs. With nixl it
    sends the prompt to a prefill worker with `kv_transfer_params` asking for a remote decode and
    one token, then the request with the prefill's answer's `kv_transfer_params` to a decode
    worker, which pulls the KV."""
    argv = [
        str(executable(venv)),
        "--host", host,
        "--port", str(port),
        *program_router.pd_worker_flags(prefill, decode),
        "--prometheus-host", host,
        "--prometheus-port", str(metrics_port),
        "--health-check-interval-secs", str(health_check_interval_secs),
        "--log-level", log_level,
    ]  # fmt: skip
    return argv


def image_trees() -> tuple[tuple[str, str], ...]:
    """(host path, path in the image) pairs: the environment at its own path (a venv names its
    interpreter by absolute path; the lab's Python layer has that interpreter) and the host
    libraries its compiled modules link (realvllm.system_files: `ldd` over every shared object
    in it; the Rust router brings its own libssl and libcrypto in vllm_router.libs/)."""
    venv = ensure_venv()
    return ((str(venv), str(venv)), *((path, path) for path in realvllm.system_files(venv)))


def main(argv: list[str] | None = None) -> int:
    return realvllm.cache_cli(
        argv,
        "python -m labkit.models.router",
        __doc__,
        {"install": ("build (or find) the cached vllm-router environment; print its path", ensure_venv)},
        lambda: {"venv": venv_dir()},
    )


if __name__ == "__main__":
    sys.exit(main())
