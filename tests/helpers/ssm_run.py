"""The model-server SSM run script (qwen_cluster/render/ssm.py) run on this machine against
stand-in `docker`, `aws`, `curl`, `sysctl` and `ip` commands, its system paths moved into a
temporary directory: what it drains, restarts, waits for and registers, as a log of calls."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from qwen_cluster.render import ssm
from qwen_cluster.render.sysctl import DROPIN_PATH

NODE_IP = "10.0.0.5"
_STUBS = {
    # docker: one container, its config label in `label`; `ps` answers as docker's filters would.
    "docker": r"""
echo "docker $*" >>"$RUN_DIR/calls"
case "$1" in
  ps)
    [ -f "$RUN_DIR/label" ] || exit 0
    for arg in "$@"; do
      case "$arg" in
        label=*) [ "${arg#label=qwen-cluster.config=}" = "$(cat "$RUN_DIR/label")" ] || exit 0 ;;
      esac
    done
    echo c0ffee ;;
  rm) rm -f "$RUN_DIR/label" ;;
  run)
    for arg in "$@"; do
      case "$arg" in --label=*) echo "${arg#--label=qwen-cluster.config=}" >"$RUN_DIR/label" ;; esac
    done ;;
esac
exit 0
""",
    # aws: describe-target-health answers the count of healthy targets in `healthy_targets`;
    # asked for the other targets out of service, one line of `out_of_service` a call (its
    # last line once the others are used up: the targets stay as they are).
    "aws": r"""
echo "aws $*" >>"$RUN_DIR/calls"
case "$*" in
  *describe-target-health*initial*)
    head -n 1 "$RUN_DIR/out_of_service"
    if [ "$(wc -l <"$RUN_DIR/out_of_service")" -gt 1 ]; then sed -i 1d "$RUN_DIR/out_of_service"; fi ;;
  *describe-target-health*) cat "$RUN_DIR/healthy_targets" ;;
esac
exit 0
""",
    # sleep: the run's polls return at once (what they wait for is in the files above).
    "sleep": 'echo "sleep $*" >>"$RUN_DIR/calls"\n',
    # curl: /health answers 200 when `serving` exists.
    "curl": r"""
echo "curl $*" >>"$RUN_DIR/calls"
[ -f "$RUN_DIR/serving" ]
""",
    "sysctl": "exit 0\n",
    # python3 runs the one NIC finder (qwen_cluster/node/nic.py, on stdin): this node's eth0
    # holds NODE_IP.
    "python3": f'cat >/dev/null; if [ "$2" = {NODE_IP} ]; then echo eth0; fi\n',
}


@dataclass
class Run:
    returncode: int
    calls: list[str]
    output: str

    def called(self, text: str) -> bool:
        return any(text in call for call in self.calls)

    def index(self, text: str) -> int:
        return next(number for number, call in enumerate(self.calls) if text in call)


class Node:
    """One node's state between runs: its container (by config label), the target group's
    healthy targets and the others out of service, whether its server answers /health."""

    def __init__(self, root: Path):
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir(parents=True)
        for name, body in _STUBS.items():
            path = self.bin / name
            path.write_text("#!/bin/bash\n" + body)
            path.chmod(0o755)
        self.healthy_targets(0)
        self.out_of_service()

    def runs(self, config_hash: str) -> None:
        (self.root / "label").write_text(config_hash + "\n")

    def healthy_targets(self, count: int) -> None:
        (self.root / "healthy_targets").write_text(f"{count}\n")

    def out_of_service(self, *answers: str) -> None:
        """What the target group answers, call after call, for the targets other than this
        replica's that are registered and not in service (ids, space-separated; "" none)."""
        (self.root / "out_of_service").write_text("".join(f"{a}\n" for a in (answers or ("",))))

    def serving(self) -> None:
        (self.root / "serving").touch()

    def run(
        self, parameters: dict[str, str], *, health_seconds: int = 0, routed: bool = False, pd: bool = False
    ) -> Run:
        """`routed`: the document of loadBalancer.routing cache-aware (its router calls); `pd`:
        serving.mode disaggregated's (the P/D router's health checks through the proxy)."""
        text = ssm.run_script(routed, pd)
        moved = {
            DROPIN_PATH: self.root / "sysctl.conf",
            ssm.ENV_FILE: self.root / "model-server.env",
            ssm.SERVER_SCRIPT: self.root / "model-server.sh",
            ssm.HF_CACHE: self.root / "huggingface",
            "/etc/sysctl.d": self.root / "sysctl.d",
            "/etc/qwen-cluster": self.root / "etc",
        }
        for path, where in moved.items():
            text = text.replace(path, str(where))
        values = {**parameters, "NodeIp": NODE_IP, "HealthSeconds": str(health_seconds)}
        for name, value in values.items():
            text = text.replace("{{ " + name + " }}", value)
        (self.root / "calls").write_text("")
        script = self.root / "run.sh"
        script.write_text(text)
        done = subprocess.run(
            ["bash", str(script)],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": f"{self.bin}:/usr/bin:/bin", "RUN_DIR": str(self.root)},
        )
        calls = (self.root / "calls").read_text().splitlines()
        return Run(done.returncode, calls, done.stdout + done.stderr)
