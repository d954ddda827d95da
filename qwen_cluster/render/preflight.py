"""Preflight: is this host what the stack config says it is? Fails with the numbers.

Signatures:
    apply_script(node_ip: str, *, min_bandwidth_gbps: float, declared_gbps: float | None,
                 interface: str | None = None, min_mtu: int = 1500, check_time_sync: bool = True,
                 os_release: str = "/etc/os-release", rdma: bool = False) -> str
    for_node(cluster: ClusterConfig, node_name: str) -> str

Checks: the OS family (Debian or RHEL), the interface holding `node_ip` (or `interface`), its
speed from /sys/class/net/<if>/speed against network.minBandwidthGbps and the declared
bareMetal.nicSpeedGbps (None skips that, e.g. in a lab of veth pairs), its MTU, time sync;
and what the model server's NCCL needs of the host that the program cannot set from the
container (docs/monitoring.md, "The ten failures"): python3 for the one NIC finder, /dev/shm
(shared with --ipc=host), and with tuning.rdma the RDMA devices and a memlock that may be
unlimited (--ulimit memlock=-1).
"""

from __future__ import annotations

from qwen_cluster.render.collective import MIN_SHM_BYTES
from qwen_cluster.render.shell import INTERFACE_OF, interface_of_function, os_family_function, quote, script


def apply_script(
    node_ip: str,
    *,
    min_bandwidth_gbps: float,
    declared_gbps: float | None,
    interface: str | None = None,
    min_mtu: int = 1500,
    check_time_sync: bool = True,
    os_release: str = "/etc/os-release",
    rdma: bool = False,
) -> str:
    find = (
        f"iface={quote(interface)}"
        if interface
        else f'{interface_of_function()}\niface=$({INTERFACE_OF} "$node_ip")'
    )
    declared = "" if declared_gbps is None else f"{declared_gbps:g}"
    time_sync = (
        """
synced=$(timedatectl show -p NTPSynchronized --value 2>/dev/null || true)
if [ "$synced" != yes ] && command -v chronyc >/dev/null; then
  chronyc tracking 2>/dev/null | grep -q 'Leap status *: Normal' && synced=yes
fi
if [ "$synced" = yes ]; then
  echo "preflight: time synchronised"
else
  fail "time is not synchronised (timedatectl NTPSynchronized=${synced:-unknown});" \
    "enable chrony or systemd-timesyncd"
fi
"""
        if check_time_sync
        else ""
    )
    body = f"""{os_family_function(os_release)}
failed=0
fail() {{ echo "preflight: FAILED: $*" >&2; failed=1; }}

family=$(os_family) || exit 1
echo "preflight: OS family $family"

if ! command -v python3 >/dev/null; then
  echo "preflight: FAILED: python3 is missing: the program finds the cluster interface with it" \\
    "(qwen_cluster/node/nic.py); install python3" >&2
  exit 1
fi

node_ip={quote(node_ip)}
{find}
if [ -z "$iface" ] || [ ! -e "/sys/class/net/$iface" ]; then
  echo "preflight: FAILED: no interface holds $node_ip (ip -o -4 addr show)" >&2
  exit 1
fi
echo "preflight: $node_ip is on $iface"

speed_mbps=$(cat "/sys/class/net/$iface/speed" 2>/dev/null || echo -1)
min_gbps={min_bandwidth_gbps:g}
declared_gbps={declared}
if [ "${{speed_mbps:--1}}" -le 0 ]; then
  fail "$iface reports no link speed (/sys/class/net/$iface/speed: $speed_mbps)"
else
  echo "preflight: $iface speed $speed_mbps Mbit/s"
  if awk -v s="$speed_mbps" -v m="$min_gbps" 'BEGIN {{exit !(s < m * 1000)}}'; then
    fail "$iface speed $speed_mbps Mbit/s is below network.minBandwidthGbps $min_gbps Gbit/s"
  fi
  if [ -n "$declared_gbps" ] \\
    && awk -v s="$speed_mbps" -v d="$declared_gbps" 'BEGIN {{exit !(s < d * 1000)}}'; then
    fail "$iface speed $speed_mbps Mbit/s is below the declared bareMetal.nicSpeedGbps $declared_gbps Gbit/s"
  fi
fi

mtu=$(cat "/sys/class/net/$iface/mtu")
echo "preflight: $iface MTU $mtu"
if [ "$mtu" -lt {min_mtu} ]; then
  fail "$iface MTU $mtu is below {min_mtu}"
fi

# The model server shares the host's /dev/shm (--ipc=host): NCCL's segments live there.
shm_kb=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {{print $2}}' || true)
if [ -z "$shm_kb" ] || [ "$shm_kb" -lt {MIN_SHM_BYTES // 1024} ]; then
  fail "/dev/shm is ${{shm_kb:-not}} KiB (df /dev/shm): NCCL needs {MIN_SHM_BYTES >> 20} MiB there;" \\
    "mount it larger (tmpfs size=)"
fi
{_rdma_checks() if rdma else ""}{time_sync}
exit "$failed"
"""
    return script("preflight checks against the stack config", body)


def _rdma_checks() -> str:
    return """
# tuning.rdma: NCCL opens the verbs devices and pins its buffers (the container gets
# /dev/infiniband and --ulimit memlock=-1); without either it falls back to TCP or fails at init.
if [ -z "$(ls -A /dev/infiniband 2>/dev/null)" ]; then
  fail "tuning.rdma is true but /dev/infiniband is empty or missing (no RDMA NIC or driver);" \\
    "set tuning.rdma: false for TCP, or load the NIC's driver"
fi
if ! (ulimit -l unlimited) 2>/dev/null; then
  fail "tuning.rdma is true but memlock cannot be unlimited here (ulimit -Hl: $(ulimit -Hl));" \\
    "docker's --ulimit memlock=-1 needs it: raise LimitMEMLOCK of docker.service or limits.conf"
fi
"""


def for_node(cluster, node_name: str) -> str:
    node = next(n for n in cluster.nodes if n.name == node_name)
    return apply_script(
        str(node.ip),
        min_bandwidth_gbps=cluster.network.min_bandwidth_gbps,
        declared_gbps=cluster.bare_metal.nic_speed_gbps if cluster.bare_metal else None,
        rdma=cluster.tuning.rdma,
    )
