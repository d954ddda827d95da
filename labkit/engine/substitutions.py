"""Every way the lab departs from what the program registered, in one place.

The lab runs the program's own commands and containers. A namespace on this machine is not
a host, though, so a few things are substituted, each for the reason given beside it:

1. Stack config (before the render): the lab's clock, the hosts the lab has, and how it
   reaches them (its SSH user, key and the host keys it generated, labkit/hosts/sshd.py); the
   endpoint's secrets (API keys, the TLS certificate of the lab's CA: labkit/cluster/endpoint.py).
2. Script text (after the render): paths that would land on this machine's disk, or on lock
   files every namespace shares (/run/lock); the scripts' polls and measurement times on the
   lab's clock (`script_clock`).
3. Commands on PATH (shims, `labkit/hosts/shims.py`): programs that would act on this
   machine rather than on the namespace (`systemctl`, `timedatectl`).
4. The Docker engine (`DOCKER`): each node runs its own dockerd, reached as the program
   reaches a host's; the images are the lab's own (`labkit/images/standins.py`), served by the
   lab's registry (`labkit/hosts/registry.py`); what this machine cannot give a container is
   adapted in one place (`labkit/hosts/dockerd.py` clamp_ulimits, the stub GPU hook).

After substitution a script must not name any of `FORBIDDEN`: if a program change brings a
new host path, the lab refuses to run it (naming the resource) instead of touching the host.
"""

from __future__ import annotations

import copy
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.models import realvllm
from qwen_cluster.config import NAMESPACE, REDACTED
from tooling import stackfile

# -------------------------------------------------------------- 1. stack config

# A veth reports 10000 Mbit/s (/sys/class/net/<if>/speed): the lab's hosts have 10 Gbit/s NICs.
VETH_GBPS = 10
# Stack-config keys holding durations in seconds, put on the lab's clock (Options.clock_scale):
# with 1/30 the hour of idle timeout is 2 minutes and the 5-minute drain 10 s, so the ratios
# the stack promises hold while a rehearsal takes seconds. Each bounds something that runs on
# that clock too: an idle connection, a stream of the stand-in's (its token delays are scaled).
CLOCK_KEYS = (
    ("loadBalancer", "idleTimeoutSeconds"),
    ("rollout", "drainTimeoutSeconds"),
    # Every monitoring duration follows the scrape interval (qwen_cluster/render/monitoring/clock.py):
    # 15 s becomes 1 s, an alert's `for` four seconds.
    ("monitoring", "scrapeIntervalSeconds"),
)
# Never on the lab's clock: a wait on what runs at real speed. rollout.healthTimeoutSeconds bounds
# a container's start and a server's load, which no lab clock makes faster (a process, a pull,
# an import of torch): scaled, 300 s became 10 s and a good change failed on a busy machine, and
# the gate's message named the 10 s as if the user had set it.


# The scripts' own pace on the lab's clock: their polls (a drain's 1 s, a health gate's 2 s, the
# verify's 5 s service wait) and the verify's measurement (ping's interval, iperf3's seconds).
# A poll only decides how soon a script notices what it waits for, never what it waits for;
# a measurement's figures do not depend on its length here (veths, no real link).
SCRIPT_CLOCK_NOTE = (
    "scripts' polls and measurements on the lab clock: whole-line `sleep N`, ping -i, iperf3 -t "
    "(substitutions.script_clock)"
)
MIN_SLEEP = 0.1  # a poll no faster than this: each costs a process or a request
MIN_PING_INTERVAL = 0.01  # ping(8): below 0.2 s only for root, which runs the verify
_SLEEP = re.compile(r"^([ \t]*)sleep (\d+(?:\.\d+)?)[ \t]*$", re.MULTILINE)  # within one line
_PING_INTERVAL = re.compile(r"(\bping [^\n]*?-i )(\d+(?:\.\d+)?)")
_IPERF_SECONDS = re.compile(r"(\biperf3 [^\n]*?-t )(\d+)")


def _seconds(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".")


def script_clock(text: str, clock_scale: float) -> str:
    """A script's polls and measurement times on the lab's clock (SCRIPT_CLOCK_NOTE): every
    whole-line `sleep N` (at least MIN_SLEEP), ping's `-i` (at least MIN_PING_INTERVAL), and
    iperf3's `-t` (whole seconds, at least 1). Nothing else of the text changes."""
    if clock_scale >= 1:
        return text
    text = _SLEEP.sub(
        lambda m: f"{m.group(1)}sleep {_seconds(max(MIN_SLEEP, float(m.group(2)) * clock_scale))}", text
    )
    text = _PING_INTERVAL.sub(
        lambda m: m.group(1) + _seconds(max(MIN_PING_INTERVAL, float(m.group(2)) * clock_scale)), text
    )
    return _IPERF_SECONDS.sub(lambda m: m.group(1) + str(max(1, round(int(m.group(2)) * clock_scale))), text)


@dataclass(frozen=True)
class SshIdentity:
    """How the lab's deployer logs in: the user, its key, and every node's host key."""

    user: str
    private_key: str = field(repr=False)
    host_keys: dict[str, str] = field(default_factory=dict)


def _is_lab_secret(value: Any) -> bool:
    """A key the lab itself wrote (plain text, or `{secure: <plain>}`), not a stack's ciphertext
    or the offline tools' throwaway key or password."""
    text = value.get("secure") if isinstance(value, dict) and set(value) == {"secure"} else value
    # The offline tools' throwaway values (key, password, TLS pairs); a validated config's mark.
    offline = (stackfile.OFFLINE_API_KEY, REDACTED, *stackfile.OFFLINE_SECRETS.values())
    return isinstance(text, str) and not text.startswith("v1:") and text not in offline


def endpoint_secrets(config: dict[str, Any], endpoint: Any) -> list[str]:
    """The lab's own API keys and TLS files in place of the stack's (which no lab can decrypt),
    handed over as `secure:` values, as the engine would: the program refuses plain-text keys.
    Keys the lab already wrote (a rotation test's) are kept; an open endpoint stays open."""
    made = []
    access = config.get(f"{NAMESPACE}:access")
    if isinstance(access, dict) and not access.get("openEndpoint"):
        keys = access.get("apiKeys") or []
        if keys and all(_is_lab_secret(key) for key in keys):
            chosen = [key.get("secure") if isinstance(key, dict) else key for key in keys]
        else:
            chosen = [endpoint.api_keys[0]]
            made.append("access.apiKeys: the lab's own key")
        access["apiKeys"] = [{"secure": key} for key in chosen]
    # Every stack with Prometheus gets the lab's monitoring password (bare metal's web config,
    # AWS's SecureString parameters), unless it says its monitoring is open on purpose; a password
    # the lab already wrote (a rotation test's) is kept, handed over as a secret like the keys.
    password = getattr(endpoint, "monitoring_password", "")
    monitoring = config.get(f"{NAMESPACE}:monitoring")
    if password and monitoring is None:
        monitoring = config[f"{NAMESPACE}:monitoring"] = {}
    if (
        password
        and isinstance(monitoring, dict)
        and monitoring.get("prometheus", True)
        and not monitoring.get("openToMonitoringCidrs")
    ):
        current = monitoring.get("password")
        if _is_lab_secret(current):
            text = current.get("secure") if isinstance(current, dict) else current
            monitoring["password"] = {"secure": text}
        else:
            monitoring["password"] = {"secure": password}
            made.append("monitoring.password: the lab's own")
        made += _monitoring_tls(config, monitoring, endpoint)
    balancer = config.setdefault(f"{NAMESPACE}:loadBalancer", {})
    if isinstance(balancer, dict):
        balancer["tls"] = {
            "certificate": {"secure": endpoint.certificate},
            "privateKey": {"secure": endpoint.private_key},
        }
        made.append("loadBalancer.tls: a certificate of the lab's own CA")
    return made


def _monitoring_tls(config: dict[str, Any], monitoring: dict[str, Any], endpoint: Any) -> list[str]:
    """monitoring.tls: a certificate of the lab's CA for the monitoring node, the CA the lab's
    clients trust (the password is never sent in clear, config/rules.py). A pair the lab already
    wrote (a rotation test's) is kept."""
    current = monitoring.get("tls")
    if isinstance(current, dict) and all(
        _is_lab_secret(current.get(key)) for key in ("certificate", "privateKey")
    ):
        monitoring["tls"] = {
            **{
                key: {"secure": value.get("secure") if isinstance(value, dict) else value}
                for key, value in current.items()
                if key in ("certificate", "privateKey")
            },
            "caCertificate": current.get("caCertificate") or endpoint.ca_certificate,
        }
        return []
    nodes = config.get(f"{NAMESPACE}:nodes") or []
    name = monitoring.get("node") or next((n.get("name") for n in nodes if n.get("role") == "master"), None)
    ip = next((n.get("ip") for n in nodes if n.get("name") == name), None)
    if ip is None:
        return []  # the config names no such node: its own validation says so
    certificate, private_key = endpoint.monitoring_tls(str(ip))
    monitoring["tls"] = {
        "certificate": {"secure": certificate},
        "privateKey": {"secure": private_key},
        "caCertificate": endpoint.ca_certificate,
    }
    return [f"monitoring.tls: a certificate of the lab's own CA for {ip}"]


def stack_config(
    raw: dict[str, Any], clock_scale: float, ssh: SshIdentity | None = None, endpoint: Any = None
) -> tuple[dict[str, Any], list[str]]:
    """The stack config the lab renders, and one line per substitution made. `endpoint`:
    labkit.cluster.endpoint.Identity, the lab's keys and certificate."""
    config = copy.deepcopy(raw)
    made: list[str] = []
    if endpoint is not None:
        made += endpoint_secrets(config, endpoint)

    def section(name: str) -> dict[str, Any] | None:
        value = config.get(f"{NAMESPACE}:{name}")
        return value if isinstance(value, dict) else None

    for name, key in CLOCK_KEYS:
        values = section(name)
        if values is not None and isinstance(values.get(key), int | float):
            scaled = max(1, round(values[key] * clock_scale))
            made.append(f"{name}.{key} {values[key]} -> {scaled} (lab clock)")
            values[key] = scaled
    tuning = section("tuning")
    if tuning is not None and tuning.get("rdma"):
        # No RDMA NIC in a namespace: the lab's hosts run NCCL over TCP, as the stack would
        # with tuning.rdma false (and the rdma step installs nothing from the network).
        tuning["rdma"] = False
        made.append("tuning.rdma true -> false (no RDMA NIC in a namespace)")
    bare_metal = section("bareMetal")
    if bare_metal is not None and bare_metal.get("nicSpeedGbps", VETH_GBPS) != VETH_GBPS:
        made.append(f"bareMetal.nicSpeedGbps {bare_metal['nicSpeedGbps']} -> {VETH_GBPS} (a veth's speed)")
        bare_metal["nicSpeedGbps"] = VETH_GBPS
    if bare_metal is not None and ssh is not None:
        # The lab's own hosts: its user and key, and the host keys its sshd's hold, pinned.
        if bare_metal.get("sshUser", "") != ssh.user:
            was = bare_metal.get("sshUser", "(default)")
            made.append(f"bareMetal.sshUser {was} -> {ssh.user} (the lab's user)")
            bare_metal["sshUser"] = ssh.user
        bare_metal["hostKeys"] = dict(ssh.host_keys)
        made.append(f"bareMetal.hostKeys: the {len(ssh.host_keys)} host keys the lab's sshd's hold")
        config[f"{NAMESPACE}:sshPrivateKey"] = ssh.private_key
        made.append("sshPrivateKey: the key the lab generated")
    return config, made


def real_vllm_config(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """With `--real-model`: the stack config with what vLLM's CPU build needs at the stack's level,
    and one line per change. Only the block size, with kv-aware routing and no --block-size of the
    stack's own (realvllm.CPU_BLOCK_SIZE says why): the router's --kv-event-block-size renders
    from the same key and must equal the replicas', so a change of the server's line alone
    (realvllm.CPU_CHANGES) would leave the router hashing 16-token blocks against 128-token
    events, never a hit."""
    section = f"{NAMESPACE}:model"
    model = config.get(section) or {}
    flags = model.get("vllmFlags") or {}
    routing = (config.get(f"{NAMESPACE}:loadBalancer") or {}).get("routing")
    if routing != "kv-aware" or "--block-size" in flags:
        return config, []
    blocks = realvllm.CPU_BLOCK_SIZE
    changed = {**config, section: {**model, "vllmFlags": {**flags, "--block-size": blocks}}}
    return changed, [
        f"model.vllmFlags --block-size (kv-aware's default 16) -> {blocks}: the CPU build's attention "
        "takes multiples of 32; the replicas and the router's --kv-event-block-size both follow it"
    ]


# -------------------------------------------------------------- 2. script text


# Host lock files (the staging's `flock /run/lock/qwen-cluster-stage.lock`): a host's own, but
# every namespace shares this machine's /run/lock, so one node's (or one lab's) 2.5 GB pull
# would wait for another's. Each node's are kept in its lab dir, under NODE_LOCK_DIR.
RUN_LOCK = "/run/lock"
NODE_LOCK_DIR = "run-lock"


def path_map(etc_root: str, state_dir: str) -> list[tuple[str, str]]:
    """Host paths the program's scripts write, and where the lab puts them for one node.

    /etc/<entry> for the entries `lifecycle.ETC_ENTRIES` copies needs no substitution: `ip netns
    exec` bind-mounts /etc/netns/<ns>/<entry> over it. A directory the host does not have
    cannot be bind-mounted (`ip netns exec` warns and goes on, and the write would land on the
    host), so it is rewritten to the node's lab dir instead; not under /etc/netns/<ns>/, where
    every `ip netns exec` would try, and fail, to mount it."""
    return [
        ("/etc/qwen-cluster", f"{state_dir}/etc-qwen-cluster"),
        ("/var/lib/qwen-cluster", state_dir),
        ("/var/cache/qwen-cluster", f"{state_dir}/cache"),
        (RUN_LOCK, f"{state_dir}/{NODE_LOCK_DIR}"),
    ]


# Applying the host's every sysctl file from inside a namespace would re-set the global keys
# (kernel.*, vm.*) of this machine: the lab applies the program's drop-in alone.
TEXT = (("sysctl -e --system", 'sysctl -e -p "$dropin"'),)
FORBIDDEN = ("/etc/qwen-cluster", "/var/lib/qwen-cluster", "/var/cache/qwen-cluster", RUN_LOCK, "--system")


class SubstitutionError(RuntimeError):
    pass


def script(text: str, *, resource: str, etc_root: str, state_dir: str) -> str:
    """A registered command's text as the lab runs it in a node's namespace."""
    for old, new in [*path_map(etc_root, state_dir), *TEXT]:
        text = text.replace(old, new)
    left = [word for word in FORBIDDEN if word in text]
    if left:
        raise SubstitutionError(
            f"{resource}: the script still names {', '.join(left)} after the lab's substitutions; "
            "add a substitution in labkit/engine/substitutions.py rather than touch this machine"
        )
    return text


def host_path(path: str, *, etc_root: str, state_dir: str) -> str:
    """A host path a container mounts (a volume's host_path), as the lab keeps it."""
    for old, new in path_map(etc_root, state_dir):
        if path == old or path.startswith(old + "/"):
            return new + path[len(old) :]
    if path.startswith("/etc/"):
        return etc_root + path[len("/etc") :]
    return path


def environment(etc_root: str, state_dir: str, bin_dir: str) -> dict[str, str]:
    """The lab hooks the bare-metal scripts read (qwen_cluster/render/shell.py LAB_HOOKS); a real
    host never has them (sshd passes only AcceptEnv variables; pulumi-command sets none)."""
    return {
        "QWEN_STATE_DIR": state_dir,  # not the /var/lib/qwen-cluster every namespace shares
        "QWEN_PERSIST": "no",  # no boot persistence: nothing is enabled for a boot that never comes
        "QWEN_SYSCTL_SCOPE": "dropin",  # only the drop-in: `--system` would re-set global keys
    }


# -------------------------------------------------------------- 3. shims on PATH

# name -> why the lab answers it itself (the handler is labkit/hosts/shims.py)
SHIMS = {
    "systemctl": "no persistence: nothing is enabled for a boot that never comes",
    "timedatectl": "every namespace shares this machine's clock: synchronised by construction",
}


def install_shims(bin_dir: Path, project_root: Path) -> Path:
    """Write one small launcher per shim into `bin_dir` (prepended to PATH in namespaces)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    python = f"PYTHONPATH={project_root} exec {sys.executable} -m labkit.hosts.shims"
    for name in SHIMS:
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\n{python} {name} "$@"\n')
        path.chmod(0o755)
    return bin_dir


# -------------------------------------------------------------- 4. the Docker engine

# What a node's Docker engine departs from a host's, each for its reason (docs/lab.md lists them).
DOCKER = {
    "one dockerd per node namespace": "a namespace is not a host: its own data-root, exec-root and "
    "socket, started in a private mount namespace with the cgroup mounts re-created "
    "(`ip netns exec` mounts a fresh sysfs) (labkit/hosts/dockerd.py)",
    "DOCKER_HOST=unix://<node socket>": "the program's `docker` and the provider's ssh reach the "
    "node's daemon as on a host they reach /var/run/docker.sock: sshd's SetEnv gives it, sudo keeps it",
    "--iptables=false --bridge=none --ip-forward=false": "host networking only (as the program runs every "
    "container), and no node turned into a router",
    "--registry-mirror / --insecure-registry, nvcr.io in the daemon's /etc/hosts": "no Docker Hub, no "
    "NGC: the lab's registry serves the images it built (labkit/images/standins.py) under the names pulled",
    "ulimits clamped (memlock, nofile)": "root here lacks CAP_SYS_RESOURCE: hard limits memlock 8 MiB, "
    "nofile 20000 (labkit/hosts/dockerd.py clamp_ulimits, the only change to a container spec)",
    "stub nvidia-container-runtime-hook": "no NVIDIA toolkit: `gpus: all` is accepted, no GPU is given",
}
