"""The programs inside the images the lab builds in place of the real ones (labkit/standins.py).

Run in a container as `python3 -m labkit.imagebin NAME ARGS...` by the small launchers the
images carry (`/usr/local/bin/vllm`, `/usr/local/bin/ray`, dcgm-exporter's entrypoint). Stdlib
only: the images hold Python, this package and the model server's few dependencies.

What a container cannot learn from the program's inputs (the lab's clock, which node it is on)
comes from the lab layer of its image, `LAB_FILE` (written by standins.lab_layer): the node is
found from `VLLM_HOST_IP`, the address the program gives every vLLM container.
"""

from __future__ import annotations

import http.server
import json
import os
import runpy
import signal
import sys
from pathlib import Path

LAB_FILE = "/etc/qcl-lab/image.json"


def _lab() -> dict:
    try:
        return json.loads(Path(LAB_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def vllm(args: list[str]) -> int:
    """`vllm serve MODEL --host H --port P ...` -> the stand-in model server (labkit/modelserver.py),
    on the lab's clock, naming the node it runs on and the image it stands in for."""
    if not args or args[0] != "serve":
        print(f"lab vllm: only `vllm serve` is modelled, not {' '.join(args)}", file=sys.stderr)
        return 2
    model = args[1] if len(args) > 1 and not args[1].startswith("-") else "Qwen/Qwen3-32B"

    def flag(name: str, default: str) -> str:
        for index, word in enumerate(args):
            if word == name and index + 1 < len(args):
                return args[index + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
        return default

    lab = _lab()
    ip = os.environ.get("VLLM_HOST_IP", "")
    node = lab.get("nodes", {}).get(ip, ip or "?")
    argv = ["labkit.modelserver", "--node", node]
    argv += ["--host", flag("--host", "0.0.0.0"), "--port", flag("--port", "8000"), "--model", model]
    argv += ["--token-delay", str(lab.get("token_delay", 0)), "--load-delay", str(lab.get("load_delay", 0))]
    argv += ["--image", str(lab.get("image", ""))]
    print(f"lab vllm: stand-in for `vllm serve {' '.join(args[1:])}`", flush=True)
    # PID 1 of its container: without a handler the kernel drops SIGTERM, and `docker stop`
    # would always wait out the grace. vLLM exits on it; so does the stand-in (unless the model
    # server installs its own handler, which then wins).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.argv = argv
    runpy.run_module("labkit.modelserver", run_name="__main__", alter_sys=True)
    return 0


def ray(args: list[str]) -> int:
    # As Ray 2.52+ does: in token mode `ray start` refuses to run without a token
    # (ray-project/ray python/ray/tests: test_ray_start_without_token_raises_error).
    if os.environ.get("RAY_AUTH_MODE") == "token" and not (
        os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    ):
        print("lab ray: RAY_AUTH_MODE=token and no RAY_AUTH_TOKEN: refused", file=sys.stderr)
        return 1
    if "--block" in args:
        print("lab ray: holding like `ray start --block`", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        signal.pause()
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
