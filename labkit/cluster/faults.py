"""The failures of docs/monitoring.md's table ("The ten failures") that the lab can produce,
injected on one node and removed again (tests/test_lab_doctor.py rehearses `doctor` against each).

Host faults (FAULTS) are a pair of functions (inject, remove) on a lab node. Container faults
(CONTAINER_FAULTS) change the node's model server as it runs on the node's real dockerd
(labkit/hosts/dockerd.py): `break_model_server` stops the program's container, parks it under another
name and starts one made from its own `docker inspect` (Config and HostConfig, as the Engine API
takes them back) with the faults' changes; `restore_model_server` removes that one and starts the
program's container again, the same container (id, spec) as before. Each change touches what one
check looks at, so several go into one container and each is still named by its own check.
All are undone by `lab down` too (the namespace, its /etc/netns directory and its dockerd go).
"""

from __future__ import annotations

import http.client
import json
import shlex
import socket
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from labkit.cluster import lifecycle
from labkit.cluster.blueprint import MEMBER_IF, LabPlan, Member
from labkit.hosts import dockerd, netns
from labkit.images import standins
from qwen_cluster import tags
from qwen_cluster.render import collective

FAULT_TABLE = "qcl_fault"
# The kernel's default ephemeral range (net.ipv4.ip_local_port_range), where NCCL, Gloo and vLLM's
# cross-node queues bind: a firewall that lets only the table's 6000-6100 through drops them.
EPHEMERAL = "32768-60999"
LOWERED_MTU = 1400


def _hosts(member: Member, text: str) -> None:
    # In place: the file is bind-mounted into the node's processes (ip netns exec).
    (netns.NETNS_ETC / member.namespace / "hosts").write_text(text)


def hostname_to_loopback(plan: LabPlan, member: Member) -> None:
    """Cause 1: the node's name on 127.0.1.1, as Debian's installer writes it."""
    _hosts(member, f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()} {member.node}\n")


def hostname_restored(plan: LabPlan, member: Member) -> None:
    _hosts(member, f"127.0.0.1 localhost\n{member.ip} {socket.gethostname()} {member.node}\n")


def lower_mtu(plan: LabPlan, member: Member) -> None:
    """Cause 7: one member's link at a smaller MTU than the others'."""
    netns.run(["ip", "-n", member.namespace, "link", "set", MEMBER_IF, "mtu", str(LOWERED_MTU)])


def restore_mtu(plan: LabPlan, member: Member) -> None:
    netns.run(["ip", "-n", member.namespace, "link", "set", MEMBER_IF, "mtu", "1500"])


def drop_dynamic_ports(plan: LabPlan, member: Member) -> None:
    """Cause 8: new connections to the ephemeral ports dropped on the node's cluster link (replies
    to its own connections pass: a stateful firewall, as ufw and firewalld are)."""
    rules = (
        f"add table inet {FAULT_TABLE}; "
        f"add chain inet {FAULT_TABLE} input {{ type filter hook input priority -10; policy accept; }}; "
        f'add rule inet {FAULT_TABLE} input iifname "{MEMBER_IF}" ct state new tcp dport {EPHEMERAL} drop'
    )
    netns.exec_in(member.namespace, ["nft", rules])


def allow_dynamic_ports(plan: LabPlan, member: Member) -> None:
    netns.exec_in(member.namespace, ["nft", f"delete table inet {FAULT_TABLE}"], check=False)


@dataclass(frozen=True)
class Fault:
    name: str
    check: str  # the doctor check that must name it (tooling/doctor.py CHECKS)
    inject: Callable[[LabPlan, Member], None]
    remove: Callable[[LabPlan, Member], None]


FAULTS = (
    Fault("hostname on loopback", "hostname", hostname_to_loopback, hostname_restored),
    Fault("a lowered MTU on one link", "mtu", lower_mtu, restore_mtu),
    Fault("a firewall dropping the dynamic ports", "dynamic-port", drop_dynamic_ports, allow_dynamic_ports),
)


# ---------------------------------------------------------------- the model server's container

MODEL_SERVER = tags.MODEL_SERVER_CONTAINER
PARKED = f"{MODEL_SERVER}-parked"  # the program's container, stopped, while a faulty one runs
# What a private IPC namespace gives /dev/shm when nothing sizes it (docker's default ShmSize).
DOCKER_SHM_BYTES = 64 * 1024 * 1024
SMALL_MEMLOCK = 64 * 1024  # bytes: `ulimit -l` reads 64 (KiB), the classic default of a host
OTHER_MODEL = "Qwen/Qwen3-14B"


class _Unix(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 60.0):
        super().__init__("docker", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def _engine(daemon: dockerd.Daemon, method: str, path: str, body: Any = None) -> Any:
    """One Docker Engine API call on the node's daemon socket (as the docker CLI makes it)."""
    connection = _Unix(str(daemon.socket))
    data = None if body is None else json.dumps(body).encode()
    connection.request(method, path, data, {"Content-Type": "application/json"} if data else {})
    response = connection.getresponse()
    text = response.read().decode(errors="replace")
    connection.close()
    if response.status >= 300:
        raise dockerd.DockerdError(f"{method} {path}: {response.status} {text[:500]}")
    return json.loads(text) if text.strip() else None


Change = Callable[[dict[str, Any], Member], None]  # edits a create body in place


@dataclass(frozen=True)
class ContainerFault:
    name: str
    check: str  # the doctor check that must name it (tooling/doctor.py CHECKS)
    row: int  # its row in docs/monitoring.md, "The ten failures"
    change: Change
    # The lab's stack is on NCCL_NET=Socket (no RDMA in a namespace): the checks that only
    # matter with RDMA (memlock, the transport line) are seen by doctor as an RDMA stack runs it.
    rdma_only: bool = False


def _script(body: dict[str, Any]) -> str:
    command = body.get("Cmd") or []
    if len(command) != 1:
        raise ValueError(f"the model server's command is not one bash script: {command!r}")
    return command[0]


def _set_script(body: dict[str, Any], text: str) -> None:
    body["Cmd"] = [text]


def _without_env(body: dict[str, Any], *names: str) -> None:
    body["Env"] = [item for item in body.get("Env") or [] if item.split("=", 1)[0] not in names]


def other_image_tag(body: dict[str, Any], member: Member) -> None:
    """Cause 10 (its image half): this member runs another tag of the model image than the
    stack's model.image (published to the lab's registry and pulled by break_model_server)."""
    body["Image"] = other_tag(str(body["Image"]))


def other_tag(image: str) -> str:
    repository, _, tag = image.rpartition(":")
    return f"{repository}:{tag}-other" if repository and "/" not in tag else f"{image}:other"


def private_ipc(body: dict[str, Any], member: Member) -> None:
    """Cause 6: no `--ipc=host`: docker's private IPC namespace and its 64 MiB /dev/shm."""
    host = body["HostConfig"]
    host["IpcMode"] = "private"
    host["ShmSize"] = DOCKER_SHM_BYTES


def loopback_host_ip(body: dict[str, Any], member: Member) -> None:
    """Cause 2: vLLM's address on this member is not the node's (loopback, as vLLM and Gloo end
    up with when the node's name resolves there)."""
    _without_env(body, "VLLM_HOST_IP")
    body["Env"].append("VLLM_HOST_IP=127.0.0.1")


def no_transport_pin(body: dict[str, Any], member: Member) -> None:
    """Cause 3: NCCL_NET not set, so a missing fast device would fall back to sockets silently."""
    _without_env(body, "NCCL_NET")


def no_interface_env(body: dict[str, Any], member: Member) -> None:
    """Cause 9: NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME not set on this member (a container
    started without the program's interface prelude, nor the variables in its environment)."""
    _without_env(body, "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
    script = _script(body)
    prelude = collective.interface_prelude()
    if prelude not in script:
        raise ValueError("the model server's script does not hold the interface prelude")
    _set_script(body, script.replace(prelude, "", 1))


def other_model_path(body: dict[str, Any], member: Member) -> None:
    """Cause 10 (its model half): this member serves another model path than the stack's."""
    script = _script(body)
    words = shlex.split(script.rsplit("\n", 1)[-1])
    if words[:3] != ["exec", "vllm", "serve"]:
        raise ValueError(f"the model server's script does not end with `exec vllm serve`: {words[:4]}")
    served = words[3]
    _set_script(body, script.replace(f"vllm serve {shlex.quote(served)} ", f"vllm serve {OTHER_MODEL} ", 1))


def small_memlock(body: dict[str, Any], member: Member) -> None:
    """Cause 5: a 64 KiB memlock limit in the container."""
    host = body["HostConfig"]
    others = [u for u in host.get("Ulimits") or [] if u.get("Name") != "memlock"]
    host["Ulimits"] = [*others, {"Name": "memlock", "Soft": SMALL_MEMLOCK, "Hard": SMALL_MEMLOCK}]


def socket_fallback_log(body: dict[str, Any], member: Member) -> None:
    """Cause 3 (its log): the container prints NCCL's own lines for a fallback to TCP sockets
    before the model server starts. The format strings: NVIDIA/nccl src/transport/net_socket.cc
    `INFO(NCCL_INIT|NCCL_NET, "NET/Socket : Using%s", line)` with `" [%d]%s:%s"` per interface,
    and src/init.cc `INFO(NCCL_INIT, "Using network %s", ...)`, behind NCCL's debug prefix
    `host:pid:tid [dev] NCCL INFO` (src/debug.cc); as quoted in tests/data/doctor/README.md."""
    prefix = f"{member.node}:1:1 [0] NCCL INFO"
    lines = (
        f"{prefix} NET/Socket : Using [0]{MEMBER_IF}:{member.ip}<0>",
        f"{prefix} Using network Socket",
    )
    echo = "".join(f"echo {shlex.quote(line)}\n" for line in lines)
    _set_script(body, echo + _script(body))


CONTAINER_FAULTS = (
    ContainerFault("VLLM_HOST_IP on loopback", "node-address", 2, loopback_host_ip),
    ContainerFault("no --ipc=host (64 MiB /dev/shm)", "shm", 6, private_ipc),
    ContainerFault("NCCL_NET not pinned", "transport-pin", 3, no_transport_pin),
    ContainerFault("the interface variables missing on one member", "interface-env", 9, no_interface_env),
    ContainerFault("another model path on one member", "model-path", 10, other_model_path),
    ContainerFault("another image tag on one member", "image", 10, other_image_tag),
    ContainerFault("a 64 KiB memlock", "memlock", 5, small_memlock, rdma_only=True),
    ContainerFault("NCCL's socket fallback in the log", "transport", 3, socket_fallback_log, rdma_only=True),
)


def break_model_server(plan: LabPlan, member: Member, faults=CONTAINER_FAULTS) -> str:
    """Run `member`'s model server with `faults` applied; the program's container is stopped
    and kept (PARKED). Returns the new container's id."""
    daemon = lifecycle.daemon(plan, member)
    original = _engine(daemon, "GET", f"/containers/{MODEL_SERVER}/json")
    body = dict(original["Config"])
    body["HostConfig"] = dict(original["HostConfig"])
    for fault in faults:
        fault.change(body, member)
    if body["Image"] != original["Config"]["Image"]:
        # Another tag: built and published as the lab publishes the stack's (lifecycle), pulled
        # by the node's dockerd from the lab's registry as `pulumi up` pulls model.image.
        knobs = lifecycle.lab_knobs(plan, lifecycle.Options())
        standins.publish(lifecycle.registry(plan), [body["Image"]], knobs)
        dockerd.docker(daemon, "pull", body["Image"])
    dockerd.docker(daemon, "stop", "--time", "10", MODEL_SERVER)
    dockerd.docker(daemon, "rename", MODEL_SERVER, PARKED)
    created = _engine(
        daemon, "POST", "/containers/create?" + urllib.parse.urlencode({"name": MODEL_SERVER}), body
    )
    _engine(daemon, "POST", f"/containers/{created['Id']}/start")
    return created["Id"]


def restore_model_server(plan: LabPlan, member: Member) -> None:
    """The program's container back: the faulty one removed, the parked one named and started."""
    daemon = lifecycle.daemon(plan, member)
    parked = dockerd.docker(daemon, "inspect", "--type", "container", PARKED, check=False)
    if parked.returncode != 0:
        return  # nothing broken here
    dockerd.docker(daemon, "rm", "--force", MODEL_SERVER, check=False)
    dockerd.docker(daemon, "rename", PARKED, MODEL_SERVER)
    dockerd.docker(daemon, "start", MODEL_SERVER)
