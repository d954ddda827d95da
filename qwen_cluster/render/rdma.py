"""RDMA userspace (the guide's libibverbs1 ibverbs-utils rdma-core) and a device check.

Signatures:
    PACKAGES: dict[str, tuple[str, ...]]            per OS family (debian, rhel)
    apply_script(*, required: bool, os_release: str = "/etc/os-release") -> str
    revert_script() -> str

With `required` (tuning.rdma true) the packages are installed and `ibv_devices` must list a
device, or the script fails saying so. Without it the script changes nothing and says why.
"""

from __future__ import annotations

from qwen_cluster.render.shell import os_family_function, script

PACKAGES: dict[str, tuple[str, ...]] = {
    "debian": ("libibverbs1", "ibverbs-utils", "rdma-core"),
    "rhel": ("libibverbs", "libibverbs-utils", "rdma-core"),
}


def apply_script(*, required: bool, os_release: str = "/etc/os-release") -> str:
    if not required:
        return script("RDMA (off)", 'echo "rdma: tuning.rdma is false; nothing to install or check"')
    debian = " ".join(PACKAGES["debian"])
    rhel = " ".join(PACKAGES["rhel"])
    body = f"""{os_family_function(os_release)}
family=$(os_family)
case "$family" in
  debian)
    missing=()
    for package in {debian}; do
      dpkg-query -W -f='${{Status}}' "$package" 2>/dev/null | grep -q "install ok installed" \\
        || missing+=("$package")
    done
    if [ "${{#missing[@]}}" -gt 0 ]; then
      echo "rdma: installing ${{missing[*]}}"
      DEBIAN_FRONTEND=noninteractive apt-get update -q
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${{missing[@]}}"
    fi
    ;;
  rhel)
    missing=()
    for package in {rhel}; do
      rpm -q "$package" >/dev/null 2>&1 || missing+=("$package")
    done
    if [ "${{#missing[@]}}" -gt 0 ]; then
      echo "rdma: installing ${{missing[*]}}"
      dnf install -y -q "${{missing[@]}}"
    fi
    ;;
esac

# ibv_devices prints a two-line header, then one line per device.
devices=$(ibv_devices 2>/dev/null | awk 'NR > 2 && NF > 0 {{print $1}}')
if [ -z "$devices" ]; then
  echo "rdma: FAILED: tuning.rdma is true but ibv_devices lists no RDMA device" \\
    "(no InfiniBand/RoCE NIC, or its driver is not loaded); set tuning.rdma false to run over TCP" >&2
  exit 1
fi
echo "rdma: devices: $(echo "$devices" | tr '\\n' ' ')"
"""
    return script("RDMA packages and device check", body)


def revert_script() -> str:
    # Removing rdma-core could break other users of the NIC; the packages stay.
    return script(
        "RDMA (nothing to revert)", 'echo "rdma: packages left installed (shared system libraries)"'
    )
