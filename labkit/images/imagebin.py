"""The programs inside the images the lab builds in place of the real ones (labkit/images/standins.py).

Run in a container as `python3 -m labkit.images.imagebin NAME ARGS...` by the small launchers the
images carry (`/usr/local/bin/vllm`, `/usr/local/bin/ray`, dcgm-exporter's entrypoint). Stdlib
only: the images hold Python, this package and the model server's few dependencies.

What a container cannot learn from the program's inputs (the lab's clock, which node it is on)
comes from the lab layer of its image, `LAB_FILE` (written by standins._vllm): the node is
found from `VLLM_HOST_IP`, the address the program gives every vLLM container.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

LAB_FILE = "/etc/qcl-lab/image.json"


def _lab() -> dict:
    try:
        return json.loads(Path(LAB_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _flag(args: list[str], name: str, default: str | None = None) -> str | None:
    """`--name value` or `--name=value` (the last one wins, as argparse's)."""
    found = default
    for index, word in enumerate(args):
        if word == name and index + 1 < len(args):
            found = args[index + 1]
        elif word.startswith(name + "="):
            found = word.split("=", 1)[1]
    return found


def _launch_error(args: list[str]) -> str | None:
    """What vLLM 0.33.0 itself refuses in a multi-node launch, in its words
    (vllm/config/parallel.py, vllm/engine/arg_utils.py, vllm/entrypoints/cli/serve.py)."""
    nnodes = int(_flag(args, "--nnodes", "1"))
    rank = int(_flag(args, "--node-rank", "0"))
    backend = _flag(args, "--distributed-executor-backend")
    api_servers = _flag(args, "--api-server-count")
    if nnodes > 1 and backend not in (None, "mp", "uni", "external_launcher"):
        return (
            "ValueError: nnodes > 1 can only be set when distributed executor backend is mp, uni "
            "or external_launcher."
        )
    if not 0 <= rank < nnodes:
        return (
            "ValueError: Invalid data-parallel launch options: `--node-rank` must be between 0 and "
            f"{nnodes - 1}; got `--node-rank {rank}`."
        )
    if "--headless" in args and api_servers is not None and int(api_servers) > 0:
        return f"ValueError: --api-server-count={api_servers} cannot be used with --headless"
    return None


def _model_error(args: list[str]) -> str | None:
    """A model given as a directory (the staged copy) must hold the model: vLLM, offline
    (HF_HUB_OFFLINE=1), refuses one without config.json at startup."""
    model = args[1] if len(args) > 1 and not args[1].startswith("-") else ""
    if model.startswith("/") and not (Path(model) / "config.json").is_file():
        return (
            f"OSError: {model} does not appear to have a file named config.json (lab: the weights "
            "were not staged into the container's cache)"
        )
    return None


def model_server_argv(args: list[str], lab: dict) -> list[str]:
    """The stand-in model server's command line (labkit/models/modelserver.py) for `vllm ARGS`, with
    vLLM 0.33.0's multi-node launch: `--nnodes N --node-rank R --master-addr A --master-port P`,
    the head (rank 0) serving the API once its N-1 members joined P, a `--headless` member
    serving no HTTP; `--shutdown-timeout` on the lab's clock, as the container's stop grace is
    (labkit/engine/executor.py)."""
    model = args[1] if len(args) > 1 and not args[1].startswith("-") else "Qwen/Qwen3-32B"
    ip = os.environ.get("VLLM_HOST_IP", "")
    node = lab.get("nodes", {}).get(ip, ip or "?")
    host = _flag(args, "--host", "0.0.0.0")
    master = f"{_flag(args, '--master-addr', '127.0.0.1')}:{_flag(args, '--master-port', '29501')}"
    argv = ["labkit.models.modelserver", "--node", node]
    if "--headless" in args:
        return [*argv, "--join", master, "--host", host]
    # Clients ask for the first --served-model-name when it is given (vLLM's rule, e.g. for a
    # staged copy: vllm/entrypoints/openai/cli_args.py), else the model path; the card's root is
    # the model path.
    served = (_flag(args, "--served-model-name") or model).split()[0]
    argv += ["--host", host, "--port", _flag(args, "--port", "8000"), "--model", served, "--root", model]
    if _flag(args, "--max-model-len"):
        argv += ["--max-model-len", str(_flag(args, "--max-model-len"))]
    nnodes = int(_flag(args, "--nnodes", "1"))
    if nnodes > 1:
        argv += ["--master-port", master.rsplit(":", 1)[1], "--members", str(nnodes - 1)]
    shutdown = float(_flag(args, "--shutdown-timeout", "0")) * float(lab.get("clock", 1))
    argv += ["--token-delay", str(lab.get("token_delay", 0)), "--load-delay", str(lab.get("load_delay", 0))]
    argv += ["--shutdown-timeout", f"{shutdown:g}", "--image", str(lab.get("image", ""))]
    return argv


def vllm(args: list[str]) -> int:
    """`vllm serve MODEL ...` -> the stand-in model server (labkit/models/modelserver.py), on the lab's
    clock, naming the node it runs on and the image it stands in for."""
    if not args or args[0] != "serve":
        print(f"lab vllm: only `vllm serve` is modelled, not {' '.join(args)}", file=sys.stderr)
        return 2
    error = _launch_error(args) or _model_error(args)
    if error:
        print(error, file=sys.stderr)
        return 1
    argv = model_server_argv(args, _lab())
    print(f"lab vllm: stand-in for `vllm serve {' '.join(args[1:])}`", flush=True)
    # PID 1 of its container: without a handler the kernel drops SIGTERM, and `docker stop`
    # would always wait out the grace. vLLM exits on it; so does the stand-in (unless the model
    # server installs its own handler, which then wins).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.argv = argv
    runpy.run_module("labkit.models.modelserver", run_name="__main__", alter_sys=True)
    return 0


# Where `ray start` leaves its raylet's pid: the container's own /tmp (tests point it elsewhere).
RAY_DIR_ENV = "QCL_LAB_RAY_DIR"
# A process that names itself `raylet` (its /proc/self/comm), as Ray's daemonised raylet is named,
# then lets go of its stdout: `ray start` returns once the name is there.
_RAYLET = (
    "import os, signal; open('/proc/self/comm', 'w').write('raylet'); "
    "os.dup2(os.open(os.devnull, os.O_WRONLY), 1); signal.pause()"
)


def _raylet_pidfile() -> Path:
    return Path(os.environ.get(RAY_DIR_ENV) or tempfile.gettempdir()) / "raylet.pid"


def ray(args: list[str]) -> int:
    """`ray start` as Ray 2.60 does it, as far as the program's launch can tell: it returns once
    the node runs, leaving its raylet behind (a process named `raylet`, which the rendered
    worker's watch looks for: qwen_cluster/render/vllm.py RAYLET_WATCH); `ray stop` ends it;
    `--block` holds the command (an image's own launch may still use it)."""
    # As Ray 2.52+ does: in token mode `ray start` refuses to run without a token
    # (ray-project/ray python/ray/tests: test_ray_start_without_token_raises_error).
    if os.environ.get("RAY_AUTH_MODE") == "token" and not (
        os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    ):
        print("lab ray: RAY_AUTH_MODE=token and no RAY_AUTH_TOKEN: refused", file=sys.stderr)
        return 1
    if any(word.startswith("--ray-client-server-port") for word in args):
        # Ray without ray[client] (grpcio), as measured with 2.60 (docs/decisions.md, "Multi-node
        # replicas: vLLM's own launch, not Ray").
        print("lab ray: Ray Client requires pip package `ray[client]`", file=sys.stderr)
        return 1
    if args[:1] == ["stop"]:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError):
            os.kill(int(_raylet_pidfile().read_text()), signal.SIGTERM)
        print("lab ray: stopped")
        return 0
    if "--block" in args:
        print("lab ray: holding like `ray start --block`", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        signal.pause()
    if args[:1] == ["start"]:
        # Started through a shell that exits at once, so the raylet is nobody's child here (as
        # Ray's daemonised raylet): whoever ends it, init reaps it (a zombie keeps its name). The
        # output is read to its end, which comes when the raylet has its name.
        started = subprocess.run(
            ["sh", "-c", '"$0" -c "$1" </dev/null 2>/dev/null & echo $!', sys.executable, _RAYLET],
            capture_output=True,
            text=True,
            check=True,
            start_new_session=True,
        )
        _raylet_pidfile().write_text(started.stdout.strip())
    print(f"lab ray: `ray {' '.join(args)}`: ok")
    return 0


def dcgm_exporter(args: list[str]) -> int:
    """No GPU here: every counter of the counters file (`-f`) served at 0 as /metrics on `-a`."""
    counters, address = "/etc/dcgm-exporter/default-counters.csv", ":9400"
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "-f":
            counters = value
        elif flag == "-a":
            address = value
    lines = []
    for row in Path(counters).read_text().splitlines():
        if row.strip() and not row.startswith("#"):
            field_name, kind = (part.strip() for part in row.split(",")[:2])
            lines += [f"# TYPE {field_name} {kind}", f'{field_name}{{gpu="0",UUID="GPU-lab",xid="0"}} 0']
    body = ("\n".join(lines) + "\n").encode()

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path.startswith("/metrics") else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            return

    host, _, port = address.rpartition(":")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    http.server.ThreadingHTTPServer((host or "0.0.0.0", int(port)), Metrics).serve_forever()
    return 0


HANDLERS = {"vllm": vllm, "ray": ray, "dcgm-exporter": dcgm_exporter}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return HANDLERS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
